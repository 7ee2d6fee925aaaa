//! Tombstones: the pod that held an IP last, kept for a while once nobody
//! holds it.
//!
//! A pod that gives up an IP leaves a pending tombstone; at the end of the
//! event the IP gets it if it has no holder then. Tombstones expire after
//! `IndexConfig::tombstone_ttl`, oldest first (`Index::tomb_queue`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use staleguard_core::ServiceKey;

use super::facts::{Kind, ObjName, Uid};
use super::table::Id;
use super::{unix_ms, Index};

#[derive(Debug, Clone)]
pub(super) struct TombState {
    pub(super) pod: ObjName,
    pub(super) uid: Uid,
    /// Sorted.
    pub(super) services: Vec<Arc<ServiceKey>>,
    pub(super) since_ms: u64,
}

impl Index {
    /// Drops tombstones older than the configured TTL.
    pub fn expire_tombstones(&mut self, now: SystemTime) {
        let now_ms = unix_ms(now);
        let ttl_ms = u64::try_from(self.config.tombstone_ttl.as_millis()).unwrap_or(u64::MAX);
        while let Some(&(since_ms, ip)) = self.tomb_queue.first() {
            if since_ms.saturating_add(ttl_ms) > now_ms {
                break;
            }
            self.tomb_queue.pop_first();
            if let Some(state) = self.ips.get_mut(&ip) {
                if state.tomb.as_ref().is_some_and(|t| t.since_ms == since_ms) {
                    state.tomb = None;
                    self.touched.push(ip);
                }
            }
        }
        self.finish(Kind::Pod, now);
    }

    /// Pod `id` (still in its old state) no longer holds `ip`; remember a
    /// tombstone if it was the last holder.
    pub(super) fn release(&mut self, ip: IpAddr, id: Id) {
        self.touched.push(ip);
        let Some(state) = self.ips.get_mut(&ip) else {
            return;
        };
        state.holders.retain(|h| *h != id);
        if !state.holders.is_empty() {
            return;
        }
        let (Some(old), Some(state)) = (self.pods.get(id), self.ips.get(&ip)) else {
            return;
        };
        // The services the pod was a member of at this IP.
        let services: Vec<Arc<ServiceKey>> = self
            .members(old, &state.entries)
            .iter()
            .map(|m| m.service.clone())
            .collect();
        self.pending_tombs.insert(
            ip,
            TombState {
                pod: old.name.clone(),
                uid: old.facts.uid.clone(),
                services,
                since_ms: 0,
            },
        );
    }
}
