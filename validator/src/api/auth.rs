//! Bearer-token authentication for `/v1`, with the token read from a file (a
//! mounted Secret) and re-read when the file changes, so a rotated Secret takes
//! effect without a restart.
//!
//! The file holds one token per line, at most two: while a token is being
//! rotated both the old and the new one are valid, so gateways can move from one
//! to the other without a window of 401s (docs/api.md, "Rotating the token").
//! Each token must be at least [`MIN_TOKEN_BYTES`] long and must not be the
//! placeholder `deploy/` ships: a guessable token is refused at start rather
//! than trusted.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use super::error::ApiError;
use crate::metrics::Metrics;

/// Why the token file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file could not be read.
    #[error("cannot read token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no token.
    #[error("token file {0} is empty")]
    Empty(PathBuf),
    /// A token is shorter than [`MIN_TOKEN_BYTES`].
    #[error(
        "token file {path}: token on line {line} is {len} bytes; use at least {MIN_TOKEN_BYTES} \
         random bytes (e.g. `openssl rand -hex 32`)"
    )]
    TooShort {
        /// The file.
        path: PathBuf,
        /// The line of the token, from 1.
        line: usize,
        /// Its length in bytes.
        len: usize,
    },
    /// A token is the placeholder shipped in `deploy/validator/token.txt`.
    #[error(
        "token file {path}: line {line} is the placeholder shipped in deploy/validator/token.txt; \
         put a random token there (e.g. `openssl rand -hex 32`)"
    )]
    Placeholder {
        /// The file.
        path: PathBuf,
        /// The line of the placeholder, from 1.
        line: usize,
    },
    /// More than two tokens.
    #[error(
        "token file {path} holds {count} tokens; at most two (the current one and, while \
         rotating, the next one), one per line"
    )]
    TooMany {
        /// The file.
        path: PathBuf,
        /// How many non-empty lines it holds.
        count: usize,
    },
}

/// The shortest token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 32;

/// What `deploy/validator/token.txt` ships with; never accepted as a token.
pub const PLACEHOLDER: &str = "replace-me-with-a-long-random-token";

/// How many tokens may be valid at once: the current one and the next one.
const MAX_TOKENS: usize = 2;

/// The expected bearer token. Its `Debug` never shows the secret.
#[derive(Clone)]
pub struct Token {
    inner: Arc<RwLock<Loaded>>,
    path: PathBuf,
}

struct Loaded {
    /// One or two tokens, each checked.
    secrets: Vec<Vec<u8>>,
    modified: Option<SystemTime>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Token {
    /// Reads the tokens from `path`: one per line, at most two, surrounding
    /// white space and blank lines ignored (`kubectl create secret --from-file`
    /// keeps a trailing newline). Refuses a short token or the placeholder.
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let loaded = load(path)?;
        Ok(Self {
            inner: Arc::new(RwLock::new(loaded)),
            path: path.to_owned(),
        })
    }

    /// True when `presented` is one of the tokens. Every token is compared, each
    /// in constant time in its bytes, so timing tells nothing of which matched.
    pub fn verify(&self, presented: &[u8]) -> bool {
        let loaded = self.inner.read().unwrap_or_else(|e| e.into_inner());
        loaded
            .secrets
            .iter()
            .fold(subtle::Choice::from(0), |any, secret| {
                any | secret.as_slice().ct_eq(presented)
            })
            .into()
    }

    /// Re-reads the file every `period` when its modification time changed. A
    /// file that became unreadable, empty or invalid keeps the old tokens,
    /// logs why, counts the failure and marks the file refused in `metrics`
    /// until a reload succeeds (`StaleguardValidatorTokenReloadFailing`).
    pub async fn watch(self, period: Duration, metrics: Arc<Metrics>) {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let modified = std::fs::metadata(&self.path)
                .and_then(|m| m.modified())
                .ok();
            let current = self
                .inner
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .modified;
            let changed = modified != current;
            let refused = metrics.token_file_refused();
            // A refused file is tried again on every tick (it may come back
            // as it was), but counted again only when it changes.
            if !changed && !refused {
                continue;
            }
            match load(&self.path) {
                Ok(loaded) => {
                    tracing::info!(
                        path = %self.path.display(),
                        tokens = loaded.secrets.len(),
                        "reloaded the API token"
                    );
                    *self.inner.write().unwrap_or_else(|e| e.into_inner()) = loaded;
                    metrics.token_reloaded(true);
                }
                Err(error) => {
                    self.inner
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .modified = modified;
                    if changed || !refused {
                        metrics.token_reloaded(false);
                        tracing::warn!(%error, "keeping the previous API token");
                    }
                }
            }
        }
    }
}

fn load(path: &Path) -> Result<Loaded, TokenError> {
    let read = |source| TokenError::Read {
        path: path.to_owned(),
        source,
    };
    let bytes = std::fs::read(path).map_err(read)?;
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let lines: Vec<(usize, &[u8])> = bytes
        .split(|b| *b == b'\n')
        .map(<[u8]>::trim_ascii)
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .map(|(i, line)| (i + 1, line))
        .collect();
    if lines.is_empty() {
        return Err(TokenError::Empty(path.to_owned()));
    }
    if lines.len() > MAX_TOKENS {
        return Err(TokenError::TooMany {
            path: path.to_owned(),
            count: lines.len(),
        });
    }
    for (line, secret) in &lines {
        if *secret == PLACEHOLDER.as_bytes() {
            return Err(TokenError::Placeholder {
                path: path.to_owned(),
                line: *line,
            });
        }
        if secret.len() < MIN_TOKEN_BYTES {
            return Err(TokenError::TooShort {
                path: path.to_owned(),
                line: *line,
                len: secret.len(),
            });
        }
    }
    let secrets = lines.into_iter().map(|(_, s)| s.to_vec()).collect();
    Ok(Loaded { secrets, modified })
}

/// The credentials of an `Authorization` value with the `Bearer` scheme, which
/// like every HTTP auth scheme is case-insensitive (RFC 9110, 11.1).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, credentials) = value.split_at(space);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| credentials.trim_ascii())
}

/// Middleware: lets a request through only with `Authorization: Bearer <token>`.
pub(crate) async fn require_token(
    State(token): State<Token>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()));
    match presented {
        Some(presented) if token.verify(presented) => Ok(next.run(request).await),
        _ => Err(ApiError::Unauthorized),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123456789abcdef0123456789abcdef";
    const B: &str = "fedcba9876543210fedcba9876543210";

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sg-token-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn reads_trims_and_verifies_without_showing_the_secret() {
        let path = temp_dir("read").join("token");
        std::fs::write(&path, format!("{A}\n")).unwrap();
        let token = Token::from_file(&path).unwrap();
        assert!(token.verify(A.as_bytes()));
        assert!(!token.verify(&A.as_bytes()[1..]));
        assert!(!token.verify(format!("{A}\n").as_bytes()));
        assert!(!token.verify(b""));
        assert!(!format!("{token:?}").contains(A));

        std::fs::write(&path, " \n").unwrap();
        assert!(matches!(Token::from_file(&path), Err(TokenError::Empty(_))));
        assert!(matches!(
            Token::from_file(&path.with_file_name("absent")),
            Err(TokenError::Read { .. })
        ));
    }

    #[test]
    fn a_token_shorter_than_32_bytes_is_refused_with_a_clear_error() {
        let path = temp_dir("short").join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let err = Token::from_file(&path).unwrap_err();
        assert!(
            matches!(
                err,
                TokenError::TooShort {
                    len: 6,
                    line: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains("at least 32"), "{text}");
        assert!(
            !text.contains("s3cret"),
            "the error shows the token: {text}"
        );
        std::fs::write(&path, &A[..31]).unwrap();
        assert!(Token::from_file(&path).is_err());
        std::fs::write(&path, A).unwrap();
        assert!(Token::from_file(&path).is_ok());
    }

    #[test]
    fn the_shipped_placeholder_is_refused() {
        let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/validator/token.txt");
        let err = Token::from_file(Path::new(shipped)).unwrap_err();
        assert!(
            matches!(err, TokenError::Placeholder { .. }),
            "{shipped}: {err:?}"
        );
        assert!(err.to_string().contains("placeholder"), "{err}");
    }

    #[test]
    fn two_tokens_are_valid_at_once_for_a_rotation_and_three_are_refused() {
        let path = temp_dir("two").join("token");
        std::fs::write(&path, format!("{A}\n\n  {B}  \n")).unwrap();
        let token = Token::from_file(&path).unwrap();
        assert!(token.verify(A.as_bytes()));
        assert!(token.verify(B.as_bytes()));
        assert!(!token.verify(format!("{A}\n{B}").as_bytes()));
        std::fs::write(&path, format!("{A}\n{B}\n{A}x\n")).unwrap();
        assert!(matches!(
            Token::from_file(&path),
            Err(TokenError::TooMany { count: 3, .. })
        ));
        std::fs::write(&path, format!("{A}\nshort\n")).unwrap();
        assert!(matches!(
            Token::from_file(&path),
            Err(TokenError::TooShort { line: 2, .. })
        ));
    }

    /// What a test's subscriber logged.
    #[derive(Clone, Default)]
    struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

    impl Log {
        fn text(&self) -> String {
            let bytes = self.0.lock().unwrap_or_else(|e| e.into_inner());
            String::from_utf8_lossy(&bytes).into_owned()
        }

        fn contains(&self, what: &str) -> bool {
            self.text().contains(what)
        }
    }

    impl std::io::Write for Log {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut bytes = self.0.lock().unwrap_or_else(|e| e.into_inner());
            bytes.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
        type Writer = Log;

        fn make_writer(&'a self) -> Log {
            self.clone()
        }
    }

    #[tokio::test]
    async fn a_reload_that_drops_the_old_token_ends_the_rotation_and_a_failed_one_is_counted() {
        let path = temp_dir("reload").join("token");
        std::fs::write(&path, A).unwrap();
        let token = Token::from_file(&path).unwrap();
        // The watcher runs on this (current-thread) runtime's thread, so the
        // thread's default subscriber sees what it logs.
        let log = Log::default();
        let _logging = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(log.clone())
                .with_ansi(false)
                .finish(),
        );
        let metrics = Arc::new(Metrics::new());
        let watcher = tokio::spawn(
            token
                .clone()
                .watch(Duration::from_millis(10), metrics.clone()),
        );
        // Make sure the modification time moves even on coarse clocks.
        let bump = |content: String| {
            let before = std::fs::metadata(&path).unwrap().modified().unwrap();
            std::fs::write(&path, content).unwrap();
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(before + Duration::from_secs(1)).unwrap();
        };
        let until = |ok: &dyn Fn() -> bool| {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !ok() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            ok()
        };
        bump(format!("{A}\n{B}\n"));
        tokio::task::yield_now().await;
        let t = token.clone();
        assert!(
            tokio::task::spawn_blocking(move || until(&|| t.verify(B.as_bytes())))
                .await
                .unwrap()
        );
        assert!(token.verify(A.as_bytes()), "both valid while rotating");
        bump(format!("{B}\n"));
        let t = token.clone();
        assert!(
            tokio::task::spawn_blocking(move || until(&|| !t.verify(A.as_bytes())))
                .await
                .unwrap()
        );
        assert!(token.verify(B.as_bytes()));
        // An invalid file keeps what was valid: wait for the watcher to say
        // it rejected the file, not for a time it might need.
        bump("short\n".into());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !log.contains("keeping the previous API token") {
            assert!(std::time::Instant::now() < deadline, "{}", log.text());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(token.verify(B.as_bytes()));
        assert_eq!(metrics.token_reload_failures(), 1, "counted once");
        assert!(metrics.token_file_refused());
        // A valid file again clears the alarm's gauge.
        bump(format!("{B}\n"));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while metrics.token_file_refused() {
            assert!(std::time::Instant::now() < deadline, "still refused");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(metrics.token_reload_failures(), 1);
        watcher.abort();
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"BEARER   abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearerabc"), None);
        assert_eq!(bearer(b"abc"), None);
    }
}
