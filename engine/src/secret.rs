//! A value that must never reach a log line: the validator's bearer token.
//!
//! The configuration derives `Debug` (so an operator can dump it while
//! debugging); the token inside it prints as a placeholder. The only way to the
//! text is [`Secret::expose`], used where the `Authorization` header is built.

/// A string that `Debug` never shows.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself: for the request header, never for a log line.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let s = Secret::new("hunter2-0123456789abcdef");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert_eq!(
            format!("{:#?}", Some(&s)),
            "Some(\n    Secret(<redacted>),\n)"
        );
        assert_eq!(s.expose(), "hunter2-0123456789abcdef");
    }
}
