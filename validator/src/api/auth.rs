//! Bearer-token authentication for `/v1`, with the token read from a file (a
//! mounted Secret) and re-read when the file changes, so a rotated Secret takes
//! effect without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use super::error::ApiError;

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
}

/// The expected bearer token. Its `Debug` never shows the secret.
#[derive(Clone)]
pub struct Token {
    inner: Arc<RwLock<Loaded>>,
    path: PathBuf,
}

struct Loaded {
    secret: Vec<u8>,
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
    /// Reads the token from `path` (surrounding white space is ignored, as
    /// `kubectl create secret --from-file` keeps a trailing newline).
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let loaded = load(path)?;
        Ok(Self {
            inner: Arc::new(RwLock::new(loaded)),
            path: path.to_owned(),
        })
    }

    /// True when `presented` is the token. Constant time in the token's bytes.
    pub fn verify(&self, presented: &[u8]) -> bool {
        let loaded = self.inner.read().unwrap_or_else(|e| e.into_inner());
        bool::from(loaded.secret.as_slice().ct_eq(presented))
    }

    /// Re-reads the file every `period` when its modification time changed. A
    /// file that became unreadable or empty keeps the old token and logs why.
    pub async fn watch(self, period: Duration) {
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
            if modified.is_none() || modified == current {
                continue;
            }
            match load(&self.path) {
                Ok(loaded) => {
                    *self.inner.write().unwrap_or_else(|e| e.into_inner()) = loaded;
                    tracing::info!(path = %self.path.display(), "reloaded the API token");
                }
                Err(error) => {
                    tracing::warn!(%error, "keeping the previous API token");
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
    let secret = bytes.trim_ascii().to_vec();
    if secret.is_empty() {
        return Err(TokenError::Empty(path.to_owned()));
    }
    Ok(Loaded { secret, modified })
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
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .map(<[u8]>::trim_ascii);
    match presented {
        Some(presented) if token.verify(presented) => Ok(next.run(request).await),
        _ => Err(ApiError::Unauthorized),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_trims_and_verifies_without_showing_the_secret() {
        let dir = std::env::temp_dir().join(format!("sg-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let token = Token::from_file(&path).unwrap();
        assert!(token.verify(b"s3cret"));
        assert!(!token.verify(b"s3cre"));
        assert!(!token.verify(b"s3cret\n"));
        assert!(!token.verify(b""));
        assert!(!format!("{token:?}").contains("s3cret"));

        std::fs::write(&path, " \n").unwrap();
        assert!(matches!(Token::from_file(&path), Err(TokenError::Empty(_))));
        assert!(matches!(
            Token::from_file(&dir.join("absent")),
            Err(TokenError::Read { .. })
        ));
    }
}
