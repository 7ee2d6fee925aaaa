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
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyLongPolls(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = self.to_string();
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
