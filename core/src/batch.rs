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
    /// The endpoints, at most [`MAX_ITEMS`]: decoding stops at the first
    /// item past the limit instead of reading them all.
    #[serde(deserialize_with = "at_most_max_items")]
    pub items: Vec<VerdictQuery>,
}

/// Decodes `items`, failing at the first item past [`MAX_ITEMS`] with an error
/// that names the limit, so that an oversized request costs the decoder no
/// more than the limit.
fn at_most_max_items<'de, D>(deserializer: D) -> Result<Vec<VerdictQuery>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct AtMost;

    impl<'de> serde::de::Visitor<'de> for AtMost {
        type Value = Vec<VerdictQuery>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_ITEMS} items")
        }

        fn visit_seq<A>(self, mut seq: A) -> Result<Self::Value, A::Error>
        where
            A: serde::de::SeqAccess<'de>,
        {
            // A size hint is the sender's word: trust it only so far.
            let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(item) = seq.next_element()? {
                if items.len() == MAX_ITEMS {
                    return Err(serde::de::Error::custom(format_args!(
                        "more than {MAX_ITEMS} items, the limit per request"
                    )));
                }
                items.push(item);
            }
            Ok(items)
        }
    }

    deserializer.deserialize_seq(AtMost)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: usize) -> String {
        let item = r#"{"service":"shop/cart","ip":"10.0.0.1"}"#;
        format!(r#"{{"items":[{}]}}"#, vec![item; n].join(","))
    }

    #[test]
    fn items_past_max_items_are_refused_with_the_limit_named() {
        let request: VerdictsRequest = serde_json::from_str(&items(3)).unwrap();
        assert_eq!(request.items.len(), 3);
        let at_limit: VerdictsRequest = serde_json::from_str(&items(MAX_ITEMS)).unwrap();
        assert_eq!(at_limit.items.len(), MAX_ITEMS);
        let error = serde_json::from_str::<VerdictsRequest>(&items(MAX_ITEMS + 1)).unwrap_err();
        assert!(
            error.to_string().contains("more than 200000 items"),
            "{error}"
        );
    }
}
