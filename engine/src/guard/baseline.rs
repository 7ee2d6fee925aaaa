//! The guard's baseline: a compact table of what the poller last applied, per
//! IP (the services it is allowed for, who holds it, its confirmation), and
//! the tallies the guard's thresholds read.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv6Addr};

use staleguard_core::Policy;

use super::judged::Judged;
use crate::buckets::{CompactRecord, Holders};

mod table;

use table::Table;

/// One IP as the guard remembers it: 12 bytes, 16 with an IPv4 key (the
/// baseline has one per IP of the index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct IpFacts {
    /// The set of services the IP is allowed for ([`Sets`]; 0: none) in the
    /// low 31 bits, and in the top bit the parity of the last reset that
    /// listed it ([`Baseline::mark`]).
    set_mark: u32,
    /// [`CompactRecord::fingerprint`]: who holds it ([`UNKNOWN_HOLDER`]
    /// when the index, not an answer, said it).
    pub(super) fingerprint: u32,
    /// 0 once the IP counts as allowed; until then, the ticket of its
    /// pending confirmation ([`Baseline::pending`]). Losing an unconfirmed
    /// IP is no loss.
    pub(super) ticket: u32,
}

pub(super) const MARK: u32 = 1 << 31;

/// The fingerprint of an IP the baseline learnt from a bucket line, which
/// does not say who holds it: a new holder of that IP is no evidence (its
/// loss counts as a loss). A real fingerprint that happens to be 0 only
/// loses that evidence for its IP.
pub(super) const UNKNOWN_HOLDER: u32 = 0;

impl IpFacts {
    pub(super) fn set(&self) -> u32 {
        self.set_mark & !MARK
    }

    pub(super) fn mark(&self) -> bool {
        self.set_mark & MARK != 0
    }

    pub(super) fn allowed(&self) -> bool {
        self.set() != 0
    }

    pub(super) fn unconfirmed(&self) -> bool {
        self.ticket != 0
    }
}

/// The sets of service ids IPs are allowed for, each kept once and named by
/// a 4-byte id (a cluster has about as many sets as services): the
/// baseline's facts name a set, not the services.
#[derive(Debug, Clone)]
pub(super) struct Sets {
    /// Set id -> its service ids, sorted; id 0 is the empty set.
    pub(super) ids: Vec<Box<[u64]>>,
    index: HashMap<Box<[u64]>, u32>,
    /// How many IPs name each set.
    refs: Vec<u32>,
    /// Confirmed IPs allowed for each set (the guard's counts by service
    /// are sums of these).
    pub(super) confirmed: Vec<u64>,
    /// Ids of sets no IP names any more, for reuse.
    free: Vec<u32>,
}

impl Default for Sets {
    fn default() -> Self {
        Self {
            ids: vec![Box::new([])],
            index: HashMap::new(),
            refs: vec![0],
            confirmed: vec![0],
            free: Vec::new(),
        }
    }
}

impl Sets {
    /// The id of the set `ids` (sorted, deduplicated), named once more.
    fn intern(&mut self, ids: &[u64]) -> u32 {
        if ids.is_empty() {
            return 0;
        }
        let set = match self.index.get(ids) {
            Some(set) => *set,
            None => {
                let ids: Box<[u64]> = ids.into();
                let set = match self.free.pop() {
                    Some(set) => {
                        if let Some(slot) = self.ids.get_mut(set as usize) {
                            *slot = ids.clone();
                        }
                        set
                    }
                    None => {
                        self.ids.push(ids.clone());
                        self.refs.push(0);
                        self.confirmed.push(0);
                        (self.ids.len() - 1) as u32
                    }
                };
                self.index.insert(ids, set);
                set
            }
        };
        if let Some(refs) = self.refs.get_mut(set as usize) {
            *refs += 1;
        }
        set
    }

    /// One IP fewer names `set`; a set no IP names is forgotten.
    pub(super) fn release(&mut self, set: u32) {
        if set == 0 {
            return;
        }
        let Some(refs) = self.refs.get_mut(set as usize) else {
            return;
        };
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            if let Some(ids) = self.ids.get_mut(set as usize) {
                self.index.remove(&**ids);
                *ids = Box::new([]);
            }
            self.free.push(set);
        }
    }

    pub(super) fn ids(&self, set: u32) -> &[u64] {
        self.ids.get(set as usize).map_or(&[], |ids| ids)
    }
}

/// IPs to `V`, an IPv4 address keyed by its 4 bytes and an IPv6 one by its
/// 16, each family in a dense [`Table`]: the baseline holds one entry per IP
/// of the index (most of them IPv4), 16 bytes a slot with the facts.
#[derive(Debug, Clone)]
pub(super) struct IpTable<V> {
    pub(super) v4: Table<u32, V>,
    pub(super) v6: Table<[u32; 4], V>,
}

impl<V> Default for IpTable<V> {
    fn default() -> Self {
        Self {
            v4: Table::default(),
            v6: Table::default(),
        }
    }
}

/// An IPv6 address as the table's key: its four words, most significant
/// first.
fn v6_key(ip: Ipv6Addr) -> [u32; 4] {
    let ip = u128::from(ip);
    [
        (ip >> 96) as u32,
        (ip >> 64) as u32,
        (ip >> 32) as u32,
        ip as u32,
    ]
}

impl<V: Default> IpTable<V> {
    pub(super) fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub(super) fn get(&self, ip: &IpAddr) -> Option<&V> {
        match ip {
            IpAddr::V4(v4) => self.v4.get(u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.get(v6_key(*v6)),
        }
    }

    #[cfg(test)]
    pub(super) fn get_mut(&mut self, ip: &IpAddr) -> Option<&mut V> {
        match ip {
            IpAddr::V4(v4) => self.v4.get_mut(u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.get_mut(v6_key(*v6)),
        }
    }

    pub(super) fn insert(&mut self, ip: IpAddr, value: V) -> Option<V> {
        match ip {
            IpAddr::V4(v4) => self.v4.insert(u32::from(v4), value),
            IpAddr::V6(v6) => self.v6.insert(v6_key(v6), value),
        }
    }

    pub(super) fn remove(&mut self, ip: &IpAddr) -> Option<V> {
        match ip {
            IpAddr::V4(v4) => self.v4.remove(u32::from(*v4)),
            IpAddr::V6(v6) => self.v6.remove(v6_key(*v6)),
        }
    }

    /// Room for `v4` and `v6` IPs of each family in all, at once rather
    /// than by growing as the table fills.
    pub(super) fn reserve(&mut self, v4: usize, v6: usize) {
        self.v4.reserve(v4);
        self.v6.reserve(v6);
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (IpAddr, &V)> {
        let v4 = self
            .v4
            .iter()
            .map(|(ip, v)| (IpAddr::from(std::net::Ipv4Addr::from(ip)), v));
        let v6 = self.v6.iter().map(|([a, b, c, d], v)| {
            let ip =
                u128::from(a) << 96 | u128::from(b) << 64 | u128::from(c) << 32 | u128::from(d);
            (IpAddr::from(Ipv6Addr::from(ip)), v)
        });
        v4.chain(v6)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.v4.values_mut().chain(self.v6.values_mut())
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&mut V) -> bool) {
        self.v4.retain(&mut keep);
        self.v6.retain(&mut keep);
    }
}

/// What the poller last applied, reduced to what the guard compares.
#[derive(Debug, Default, Clone)]
pub struct Baseline {
    pub(super) ips: IpTable<IpFacts>,
    pub(super) sets: Sets,
    pub(super) counts: Counts,
    /// Pending confirmations, in order: IPs newly allowed until the time
    /// said hold tickets up to the one said. Confirming them scans the
    /// table once for every IP whose ticket has come (an IP removed or
    /// allowed again since has another ticket, or none).
    pub(super) pending: VecDeque<(u64, u32)>,
    /// The last ticket handed out.
    pub(super) ticket: u32,
    /// The parity of the resets applied: a reset updates the baseline in
    /// place (never two baselines in the VM at once), marks every IP it
    /// lists, and then drops every IP it did not mark.
    pub(super) mark: bool,
    /// The services the validator knows, by id.
    pub(super) known: HashSet<u64>,
    /// False until the poller applied a full snapshot or seeded the
    /// baseline from the index ([`super::Guard::seed`]): before, there is
    /// nothing to compare with.
    pub(super) armed: bool,
}

/// The baseline's tallies of allowed IPs (by service: [`Sets::confirmed`]).
#[derive(Debug, Default, Clone)]
pub(super) struct Counts {
    /// Confirmed IPs allowed for at least one service.
    pub(super) allowed_ips: u64,
    /// Allowed IPs not confirmed yet.
    pub(super) unconfirmed_ips: u64,
}

// === impl Baseline ===

impl Baseline {
    /// Remembers `record`: confirmed or pending as `ticket` says (`None`: a
    /// new ticket, due at `confirm_at_ms`).
    pub(super) fn insert(
        &mut self,
        policy: &Policy,
        record: &CompactRecord,
        ticket: Option<u32>,
        confirm_at_ms: u64,
    ) {
        let judged = Judged::of(Some(record));
        let facts = self.facts(policy, &judged, record.fingerprint, ticket, confirm_at_ms);
        if let Some(facts) = facts {
            self.ips.insert(record.ip, facts);
        }
    }

    /// Remembers `ip` as a bucket line of the index says it is, confirmed,
    /// its holder unknown ([`UNKNOWN_HOLDER`]).
    pub(super) fn insert_line(&mut self, policy: &Policy, ip: IpAddr, holders: Holders) {
        let judged = Judged::of_line(ip, Some(holders));
        if let Some(facts) = self.facts(policy, &judged, UNKNOWN_HOLDER, Some(0), 0) {
            self.ips.insert(ip, facts);
        }
    }

    /// What to remember of an IP `judged` says this of, counted; `None`
    /// when there is nothing to remember.
    fn facts(
        &mut self,
        policy: &Policy,
        judged: &Judged,
        fingerprint: u32,
        ticket: Option<u32>,
        confirm_at_ms: u64,
    ) -> Option<IpFacts> {
        let allowed = judged.allowed(policy);
        if allowed.is_empty() && !judged.has_pods() {
            // Destroyed or vacant: nothing to lose, nothing to remember.
            return None;
        }
        let ticket = match ticket {
            _ if allowed.is_empty() => 0,
            Some(ticket) => ticket,
            None => self.pend(confirm_at_ms),
        };
        let set = self.sets.intern(&allowed);
        let facts = IpFacts {
            set_mark: set | if self.mark { MARK } else { 0 },
            fingerprint,
            ticket,
        };
        self.counts.add(&mut self.sets, &facts, 1);
        Some(facts)
    }

    /// A new ticket, due at `at_ms`.
    fn pend(&mut self, at_ms: u64) -> u32 {
        let Some(ticket) = self.ticket.checked_add(1) else {
            // Four billion tickets: confirm what is pending early and
            // count again.
            self.confirm_all();
            self.ticket = 1;
            self.pending.push_back((at_ms, 1));
            return 1;
        };
        self.ticket = ticket;
        match self.pending.back_mut() {
            Some((at, last)) if *at == at_ms => *last = ticket,
            _ => self.pending.push_back((at_ms, ticket)),
        }
        ticket
    }

    /// Forgets `ip`; returns what was known of it.
    pub(super) fn remove(&mut self, ip: &IpAddr) -> Option<IpFacts> {
        let old = self.ips.remove(ip)?;
        self.counts.add(&mut self.sets, &old, -1);
        self.sets.release(old.set());
        Some(old)
    }

    /// Confirms the IPs whose time has come at `now_ms`.
    pub(super) fn confirm_due(&mut self, now_ms: u64) {
        let mut upto = None;
        while let Some(&(at, last)) = self.pending.front() {
            if at > now_ms {
                break;
            }
            self.pending.pop_front();
            upto = Some(last);
        }
        if let Some(upto) = upto {
            self.confirm_upto(upto);
        }
    }

    /// Confirms every pending IP.
    fn confirm_all(&mut self) {
        self.pending.clear();
        self.confirm_upto(u32::MAX);
    }

    /// Confirms every IP whose ticket is at most `upto`.
    fn confirm_upto(&mut self, upto: u32) {
        let Baseline {
            ips, sets, counts, ..
        } = self;
        for facts in ips.values_mut() {
            if facts.unconfirmed() && facts.ticket <= upto {
                counts.add(sets, facts, -1);
                facts.ticket = 0;
                counts.add(sets, facts, 1);
            }
        }
    }

    /// Confirmed IPs allowed for the service with id `id`.
    pub(super) fn members(&self, id: u64) -> u64 {
        let sets = &self.sets;
        sets.ids
            .iter()
            .zip(&sets.confirmed)
            .filter(|(ids, _)| ids.contains(&id))
            .map(|(_, n)| n)
            .sum()
    }
}

// === impl Counts ===

impl Counts {
    /// Adds (`sign` 1) or takes away (-1) an IP's share.
    pub(super) fn add(&mut self, sets: &mut Sets, facts: &IpFacts, sign: i64) {
        if !facts.allowed() {
            return;
        }
        if facts.unconfirmed() {
            self.unconfirmed_ips = self.unconfirmed_ips.saturating_add_signed(sign);
            return;
        }
        self.allowed_ips = self.allowed_ips.saturating_add_signed(sign);
        if let Some(n) = sets.confirmed.get_mut(facts.set() as usize) {
            *n = n.saturating_add_signed(sign);
        }
    }
}
