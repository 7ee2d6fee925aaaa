//! Many verdicts in one request: `POST /v1/verdicts`, what the audit asks a
//! validator for every endpoint a gateway holds.
//!
//! Each item is judged by [`crate::decide`] exactly as `GET /v1/verdict`
//! judges one, against one consistent view of the index (one generation, one
//! freshness), so an audit of thousands of endpoints costs one round trip.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::service::ServiceKey;
use crate::verdict::{Policy, Verdict};
use crate::wire::{Freshness, IpRecord};

/// The most items one request may carry: a large gateway holds tens of
/// thousands of endpoints; far more is a mistake, not an audit.
pub const MAX_ITEMS: usize = 200_000;

/// One endpoint to judge: the service its cluster routes to, and its IP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictQuery {
    /// The service the gateway cluster routes to.
    pub service: ServiceKey,
    /// The endpoint's IP.
    pub ip: IpAddr,
    /// The rules for this item, when they differ from the request's (a
    /// gateway whose clusters carry different plugin configurations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
}

/// Which answer items carry the record they were judged on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Records {
    /// Every item (the default).
    #[default]
    All,
    /// Items whose reason is not `member`: who holds a recycled IP, when a
    /// destroyed one lost its pod. At a healthy gateway most endpoints are
    /// members, so this keeps a large answer small.
    NotMember,
    /// None.
    None,
}

/// The body of `POST /v1/verdicts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictsRequest {
    /// The rules to judge by (defaults as the filter's).
    #[serde(default)]
    pub policy: Policy,
    /// Which items carry their record.
    #[serde(default)]
    pub records: Records,
    /// The endpoints, at most [`MAX_ITEMS`].
    pub items: Vec<VerdictQuery>,
}

/// One endpoint's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictItem {
    /// The service asked about.
    pub service: ServiceKey,
    /// The IP asked about.
    pub ip: IpAddr,
    /// The verdict.
    pub verdict: Verdict,
    /// Whether the index knows the service.
    pub service_known: bool,
    /// What the index holds for the IP (the `verdict` view: no uids, ports or
    /// slice conditions), if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<IpRecord>,
}

/// The answer to `POST /v1/verdicts`: one item per query, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictsAnswer {
    /// Wire major version.
    pub v: u32,
    /// The index generation every item was judged at.
    pub generation: u64,
    /// How current the data was.
    pub freshness: Freshness,
    /// The verdicts, in the order of the request's items.
    pub items: Vec<VerdictItem>,
}
