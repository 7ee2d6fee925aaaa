//! Answers in pages: how a client asks for a large answer a piece at a time.
//!
//! A gateway that gives `page_bytes=L` on `/v1/snapshot` or `/v1/changes`
//! gets, when the encoded answer is longer than `L`, its first `L` bytes
//! with [`LENGTH_HEADER`] (the whole answer's length) and [`ID_HEADER`] (an
//! opaque name for it), and fetches the rest from `/v1/answer` with that id
//! and an offset ([`ANSWER_PATH`]). Every page is a slice of the one encoded
//! answer, so the bytes put back together are exactly the unpaged answer.
//! An answer that fits in one page comes as it always did, without these
//! headers. Why: Envoy's async HTTP client holds a callout's whole answer
//! before it hands it over, in slices its allocator keeps; one small page at
//! a time keeps that small (docs/api.md, "Answers in pages").

/// The whole answer's length in bytes, on its first page and on every page.
pub const LENGTH_HEADER: &str = "staleguard-answer-length";

/// The answer's opaque id, to ask for its further pages with.
pub const ID_HEADER: &str = "staleguard-answer-id";

/// Where a page starts in the whole answer (on every page of `/v1/answer`).
pub const OFFSET_HEADER: &str = "staleguard-answer-offset";

/// The path further pages are asked for at.
pub const ANSWER_PATH: &str = "/v1/answer";

/// The least page a validator serves: a smaller `page_bytes` is raised to
/// it, so a client cannot make it answer in pages of a few bytes.
pub const MIN_PAGE_BYTES: u32 = 16 * 1024;

/// The page size a validator serves for a request's `page_bytes`.
pub fn page_len(page_bytes: u32) -> u32 {
    page_bytes.max(MIN_PAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_page_is_raised_to_the_floor() {
        assert_eq!(page_len(0), MIN_PAGE_BYTES);
        assert_eq!(page_len(100), MIN_PAGE_BYTES);
        assert_eq!(page_len(256 * 1024), 256 * 1024);
    }
}
