//! A poller that takes the lease over (or starts while shared data holds an
//! index) takes the guard's baseline from the index: what its predecessor
//! applied is what readers serve, so it judges answers as the predecessor
//! would have, and an answer the predecessor was holding stays held.
//!
//! Without this, a takeover would open the door the guard exists to keep
//! shut: the successor's first answer would be its reference, whatever it
//! dropped. That happens when the owner's thread stalls for longer than
//! `lease_ttl_ms` while it holds an answer (seen with the native module at a
//! machine load of 20: Envoy's main thread stalled 8-20 s).
//!
//! Every bucket of the layout `meta` names is read once (one shared-data read
//! each; about 19,000 at 150,000 IPs), through [`Bucket::read`] and
//! [`Holders`] as the poller's own delta writes read them. What the index
//! cannot say, and the successor therefore assumes:
//!
//! - **Confirmation**: every IP it seeds is confirmed. An IP its predecessor
//!   had newly allowed (less than `confirm_ms` ago) is protected sooner than
//!   it would have been: one more answer may be held, none let through.
//! - **Who holds an IP**: a line keeps no pod names, so a seeded IP's holder
//!   is unknown ([`UNKNOWN_HOLDER`]) until an answer rewrites it; a delta
//!   that hands it to another pod is not evidence for that IP (only a
//!   tombstone is), so its loss counts, and the successor holds rather than
//!   lets through.
//! - **Which services the validator knows**: those the lines name. A service
//!   with no IP cannot lose one, so the others do not matter to the guard.
//! - **Names**: services are known by id until an answer names them (a hold
//!   reported before that names a service by its id).
//!
//! A bucket that cannot be read (a value that is not a bucket, a line this
//! build cannot decode) seeds nothing: its IPs are neither allowed nor lost,
//! so the thresholds judge an answer by the IPs that could be read (the
//! ratio of those it would drop). The other choices are worse: not seeding
//! at all lets the next answer through whatever it drops, and refusing every
//! answer would keep a damaged index for good. Requests to those IPs get the
//! failure policy's verdict on a corrupt entry meanwhile, and the next reset
//! rewrites the bucket.

#[cfg(doc)]
use super::baseline::UNKNOWN_HOLDER;
use super::Guard;
#[cfg(doc)]
use crate::buckets::Holders;
use crate::buckets::{self, Bucket};
use crate::entry::Entry;
use crate::host::SharedData;
use crate::store::Meta;

/// What seeding the baseline from the index found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seeded {
    /// IPs the baseline holds now (allowed, or held by a pod).
    pub ips: u64,
    /// Of those, IPs allowed for at least one service.
    pub allowed_ips: u64,
    /// Buckets, or lines, that could not be read: their IPs are not in the
    /// baseline.
    pub unreadable: u64,
}

// === impl Guard ===

impl Guard {
    /// Replaces the baseline with the index `meta` describes in `store`,
    /// every IP confirmed, and forgets any hold (a successor starts without
    /// one: it judges the next answer itself). Does nothing when the guard
    /// is off.
    pub fn seed(&mut self, store: &dyn SharedData, meta: &Meta) -> Option<Seeded> {
        if !self.config.enabled {
            return None;
        }
        self.reset();
        let mut seeded = Seeded::default();
        let b = &mut self.baseline;
        // Most IPs are IPv4: room for all of them at once (the table is the
        // largest thing the guard keeps).
        b.ips
            .reserve(usize::try_from(meta.entries).unwrap_or(usize::MAX), 0);
        for index in 0..meta.buckets {
            let Ok((value, _)) = store.get(&buckets::bucket_key(meta.buckets, index)) else {
                seeded.unreadable += 1;
                continue;
            };
            let value = value.unwrap_or_default();
            let bucket = Bucket::read(&value, meta.load);
            if bucket.is_empty() {
                // Absent, written under an older load, or unreadable: only
                // the last is worth telling.
                if corrupt(&value, meta.load) {
                    seeded.unreadable += 1;
                }
                continue;
            }
            for (ip, holders) in bucket.holders() {
                match holders {
                    Some(holders) => b.insert_line(&self.policy, ip, holders),
                    None => seeded.unreadable += 1,
                }
            }
        }
        // The services the lines name: the only ones an answer can take an
        // allowed IP from.
        b.known.extend(b.sets.ids.iter().flatten().copied());
        b.armed = true;
        seeded.ips = b.ips.len() as u64;
        seeded.allowed_ips = b.counts.allowed_ips;
        Some(seeded)
    }
}

/// True when a bucket value that reads as empty is not a bucket at all.
fn corrupt(value: &[u8], load: u64) -> bool {
    // No IP is the unspecified address: `find` reads every line and tells
    // an unreadable one.
    !value.is_empty()
        && matches!(
            buckets::find(value, &std::net::Ipv4Addr::UNSPECIFIED.into(), load),
            Entry::Corrupt
        )
}

#[cfg(test)]
mod tests;
