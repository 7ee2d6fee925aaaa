//! What one record of an answer says, for the guard: its holders, and whether
//! the verdict rules allow its IP for a service.

use std::net::IpAddr;

use staleguard_core::{decide, Action, IpRecord, Policy};

use crate::buckets::{placeholder, CompactRecord, Holders};

/// What an answer's record says, for the guard: the line it decodes to, and
/// the record a verdict reads (services as [`placeholder`]s of their ids).
pub(super) struct Judged {
    holders: Option<Holders>,
    record: Option<IpRecord>,
}

impl Judged {
    pub(super) fn of(record: Option<&CompactRecord>) -> Self {
        match record {
            Some(record) => Self::of_line(record.ip, record.holders()),
            None => Self::of_line(IpAddr::from([0, 0, 0, 0]), None),
        }
    }

    /// What a line of `ip` says (`None`: no line, or a vacant one).
    pub(super) fn of_line(ip: IpAddr, holders: Option<Holders>) -> Self {
        Self {
            record: holders.as_ref().map(|h| h.record_by_ids(ip)),
            holders,
        }
    }

    /// True when a pod holds the IP.
    pub(super) fn has_pods(&self) -> bool {
        self.holders.as_ref().is_some_and(|h| !h.pods.is_empty())
    }

    /// True when the verdict for service `id` on fresh data allows. The
    /// verdict rules themselves, so "allowed" cannot drift from what requests
    /// get.
    pub(super) fn allows(&self, policy: &Policy, id: u64) -> bool {
        decide(policy, true, &placeholder(id), true, self.record.as_ref()).action == Action::Allow
    }

    /// Every service the record allows the IP for, sorted.
    pub(super) fn allowed(&self, policy: &Policy) -> Vec<u64> {
        let mut ids = self
            .holders
            .as_ref()
            .map(Holders::service_ids)
            .unwrap_or_default();
        ids.retain(|id| self.allows(policy, *id));
        ids
    }
}
