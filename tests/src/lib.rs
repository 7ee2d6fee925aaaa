//! The end-to-end harness: starts real processes (Envoy, the validator, the test
//! API server, "pods" on loopback addresses) and cleans up after them.
//!
//! Start with [`process`]: how a test finds a dependency (and why, with
//! `CI=true`, a missing one fails instead of skipping) and how a child process
//! is killed when the test ends, however it ends.

pub mod process;
