//! API errors: every failure is a status and a JSON body a script can read.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// Why an API request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed: a bad IP, service, number or wire version.
    #[error("{0}")]
    BadRequest(String),
    /// No or wrong bearer token.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// Nothing at that path, or no record for that IP.
    #[error("{0}")]
    NotFound(String),
    /// A paged answer the validator no longer holds.
    #[error("{0}")]
    Gone(String),
    /// The request body is over its limit (named in the message).
    #[error("{0}")]
    TooLarge(String),
    /// Too many long polls are open at once.
    #[error("too many concurrent long polls (limit {0}); retry later")]
    TooManyLongPolls(usize),
    /// Building the answer failed (a bug; logged).
    #[error("the answer could not be built; see the validator's log")]
    Internal,
}

impl From<super::answers::BuildFailed> for ApiError {
    fn from(failed: super::answers::BuildFailed) -> Self {
        tracing::error!(error = %failed, "cannot answer");
        ApiError::Internal
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

#[derive(Serialize)]
struct Detail<'a> {
    code: &'static str,
    message: &'a str,
}

impl ApiError {
    /// The stable machine-readable code of the error.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "bad_request",
            ApiError::Unauthorized => "unauthorized",
            ApiError::NotFound(_) => "not_found",
            ApiError::Gone(_) => "gone",
            ApiError::TooLarge(_) => "too_large",
            ApiError::TooManyLongPolls(_) => "too_many_long_polls",
            ApiError::Internal => "internal",
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyLongPolls(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = self.to_string();
        // A client that is refused learns why from the body, and the
        // operator from this line: a gateway whose requests are all refused
        // (a bad token, a wire version this validator does not serve) is
        // otherwise silent here. A miss of `/v1/ips/{ip}` is an answer,
        // not a refusal.
        match &self {
            ApiError::NotFound(_) => tracing::debug!(code = self.code(), %message, "not found"),
            ApiError::Internal => {}
            _ => tracing::warn!(code = self.code(), %message, "refused a request"),
        }
        let body = Json(Body {
            error: Detail {
                code: self.code(),
                message: &message,
            },
        });
        let mut response = (self.status(), body).into_response();
        if let ApiError::Unauthorized = self {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        if let ApiError::TooManyLongPolls(_) = self {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_refused_request_is_logged_with_its_reason() {
        let path =
            std::env::temp_dir().join(format!("staleguard-refusals-{}.log", std::process::id()));
        let log = Arc::new(std::fs::File::create(&path).unwrap());
        let subscriber = tracing_subscriber::fmt()
            .with_writer(log)
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let _ = ApiError::BadRequest("wait=-1 is out of range".into()).into_response();
            let _ = ApiError::Unauthorized.into_response();
            let _ = ApiError::NotFound("the validator knows nothing of 10.0.0.7".into())
                .into_response();
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(
            text.contains("WARN") && text.contains("refused a request"),
            "{text}"
        );
        assert!(
            text.contains("code=\"bad_request\"") || text.contains("code=bad_request"),
            "{text}"
        );
        assert!(text.contains("wait=-1 is out of range"), "{text}");
        assert!(text.contains("missing or invalid bearer token"), "{text}");
        assert!(
            !text.contains("knows nothing"),
            "a miss is no refusal: {text}"
        );
    }
}
