//! The end-to-end harness: starts real processes (Envoy, the validator, the test
//! API server, "pods" on loopback addresses) and cleans up after them.
//!
//! Start with [`process`]: how a test finds a dependency (and why, with
//! `CI=true`, a missing one fails instead of skipping) and how a child process
//! is killed when the test ends, however it ends.
//!
//! [`envoy`] is the one Envoy harness: a gateway described once
//! ([`envoy::Gateway`]), run ([`envoy::Envoy`]), its metrics read and waited
//! for, by the filter tests, the scenes, the Istio tests and the benchmarks.
//!
//! The end-to-end scenarios play a stuck control plane with a simulated
//! cluster: [`world`] keeps the truth and writes it for the validator and, late
//! or never, for Envoy ([`eds`]); [`pods`] are servers on loopback addresses
//! that count what reached them; [`traffic`] sends requests and counts what came
//! back.
//!
//! Against a real Kubernetes API server: [`apiserver`] runs the test server
//! (k8s.io/apiserver + etcd, see docs/apiserver.md), writes objects as the real
//! actors do and injects faults; [`kube_source`] runs the validator's watchers
//! against it.
//!
//! [`audit`] runs `staleguard-validator audit` against a gateway's admin port.

pub mod apiserver;
pub mod audit;
pub mod blocking;
pub mod demo;
pub mod eds;
pub mod envoy;
pub mod fake_validator;
pub mod h2;
pub mod incident;
pub mod istio;
pub mod kube_source;
pub mod pods;
pub mod process;
pub mod scene;
pub mod tls;
pub mod traffic;
pub mod validator;
pub mod world;
