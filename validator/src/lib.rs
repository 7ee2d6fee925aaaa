//! The staleguard validator (work in progress: see issue 2).
