//! A small HTTP/1.1 client for the audit, whose errors say *where* a request
//! failed: nobody answered (unreachable), or the answer broke off or is not
//! what was asked for. The audit turns them into distinct exit statuses.

use std::time::Duration;

use axum::body::Bytes;
use http::{header, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// No connection, or no answer within the timeout.
    #[error("{url}: {detail}")]
    Unreachable {
        /// What was asked.
        url: String,
        /// Why.
        detail: String,
    },
    /// The answer started but did not complete.
    #[error("{url}: the answer broke off: {detail}")]
    Truncated {
        /// What was asked.
        url: String,
        /// Why.
        detail: String,
    },
    /// An answer other than 200.
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        /// What was asked.
        url: String,
        /// The status.
        status: u16,
        /// The start of the body.
        body: String,
    },
}

/// Why a base URL is not usable.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not an {1}://HOST:PORT address")]
pub struct BadUrl(pub String, pub &'static str);

/// `http://host:port` from `host:port` or `http://host:port[/]`: a gateway's
/// admin port, which speaks plain HTTP.
pub fn base_url(text: &str) -> Result<String, BadUrl> {
    parse_base(text, &["http"], "http")
}

/// The validator's base URL: `https://host:port` (verified against
/// `--validator-ca-file`), or `http://host:port` when plain HTTP is chosen;
/// `host:port` alone is plain HTTP.
pub fn validator_url(text: &str) -> Result<String, BadUrl> {
    parse_base(text, &["https", "http"], "http(s)")
}

fn parse_base(text: &str, schemes: &[&str], says: &'static str) -> Result<String, BadUrl> {
    let bad = || BadUrl(text.to_owned(), says);
    let with_scheme = if text.contains("://") {
        text.to_owned()
    } else {
        format!("http://{text}")
    };
    let uri: Uri = with_scheme.parse().map_err(|_| bad())?;
    let scheme = uri
        .scheme_str()
        .filter(|s| schemes.contains(s))
        .ok_or_else(bad)?;
    if uri.port_u16().is_none() || !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad());
    }
    let authority = uri.authority().ok_or_else(bad)?;
    Ok(format!("{scheme}://{authority}"))
}

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// The client; cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: HyperClient<Connector, Full<Bytes>>,
    timeout: Duration,
}

impl Client {
    /// A client whose every request (answer included) takes at most `timeout`.
    /// `https://` URLs are verified against the PEM certificates of `ca` (the
    /// validator's CA, `--validator-ca-file`); without one they fail.
    pub fn new(timeout: Duration, ca: Option<&std::path::Path>) -> Result<Self, String> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        if let Some(ca) = ca {
            let at = |e: &dyn std::fmt::Display| format!("{}: {e}", ca.display());
            for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).map_err(|e| at(&e))? {
                roots.add(cert.map_err(|e| at(&e))?).map_err(|e| at(&e))?;
            }
            if roots.is_empty() {
                return Err(at(&"holds no PEM certificate"));
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS configuration: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(timeout));
        http.set_nodelay(true);
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            inner: HyperClient::builder(TokioExecutor::new()).build(connector),
            timeout,
        })
    }

    /// `GET url`, the whole body of a 200 answer.
    pub async fn get(&self, url: &str) -> Result<Bytes, FetchError> {
        self.send(Method::GET, url, None, None).await
    }

    /// `POST url` with a JSON body and an optional bearer token.
    pub async fn post_json(
        &self,
        url: &str,
        body: Vec<u8>,
        token: Option<&str>,
    ) -> Result<Bytes, FetchError> {
        self.send(Method::POST, url, Some(body), token).await
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<Vec<u8>>,
        token: Option<&str>,
    ) -> Result<Bytes, FetchError> {
        let unreachable = |detail: String| FetchError::Unreachable {
            url: url.to_owned(),
            detail,
        };
        let mut request = Request::builder().method(method).uri(url);
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| unreachable(format!("cannot build the request: {e}")))?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        let response = match tokio::time::timeout_at(deadline, self.inner.request(request)).await {
            Err(_) => return Err(unreachable(format!("no answer within {:?}", self.timeout))),
            Ok(Err(e)) if e.is_connect() => return Err(unreachable(chain(&e))),
            // Connected, then the answer failed before its headers were whole.
            Ok(Err(e)) => {
                return Err(FetchError::Truncated {
                    url: url.to_owned(),
                    detail: chain(&e),
                })
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let collected = tokio::time::timeout_at(deadline, response.into_body().collect()).await;
        let body = match collected {
            Err(_) => {
                return Err(FetchError::Truncated {
                    url: url.to_owned(),
                    detail: format!("the body did not complete within {:?}", self.timeout),
                })
            }
            Ok(Err(e)) => {
                return Err(FetchError::Truncated {
                    url: url.to_owned(),
                    detail: chain(&e),
                })
            }
            Ok(Ok(body)) => body.to_bytes(),
        };
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            return Err(FetchError::Status {
                url: url.to_owned(),
                status: status.as_u16(),
                body: text.trim().to_owned(),
            });
        }
        Ok(body)
    }
}

/// An error and its sources on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_take_host_port_or_an_http_url() {
        assert_eq!(
            base_url("127.0.0.1:15000").unwrap(),
            "http://127.0.0.1:15000"
        );
        assert_eq!(
            base_url("http://validator.sg.svc:8080/").unwrap(),
            "http://validator.sg.svc:8080"
        );
        assert_eq!(base_url("[::1]:9901").unwrap(), "http://[::1]:9901");
        assert_eq!(
            validator_url("https://validator.sg.svc:8443").unwrap(),
            "https://validator.sg.svc:8443"
        );
        assert_eq!(validator_url("v:8080").unwrap(), "http://v:8080");
        assert!(validator_url("ftp://v:21").is_err());
        for bad in [
            "localhost",
            "https://v:8080",
            "http://v:8080/v1",
            "v:port",
            "",
        ] {
            assert!(base_url(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_closed_port_is_unreachable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = Client::new(Duration::from_secs(2), None).unwrap();
        let err = client
            .get(&format!("http://127.0.0.1:{port}/clusters"))
            .await
            .unwrap_err();
        assert!(matches!(err, FetchError::Unreachable { .. }), "{err}");
    }
}
