//! The one canonical form of an IP address, for validator and filter alike.
//!
//! Kubernetes, Envoy and the kernel can all spell an IPv4 address as an
//! IPv4-mapped IPv6 address (`::ffff:10.0.0.7`). The index keys IPs by their
//! canonical form, so both sides must map an address the same way before they
//! look it up: one rule, one place.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) become the IPv4 address; every
/// other address is already canonical. (IPv4-*compatible* addresses, `::a.b.c.d`,
/// are deprecated and stay IPv6, as the standard library reads them.)
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// An IP network in CIDR notation (`10.244.0.0/16`, `fd00:10:244::/56`): the
/// pod networks of this cluster, outside of which an address is not this
/// cluster's pod and is not judged (docs/index.md, "Multi-cluster and
/// ambient").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    len: u8,
}

/// Why a text is not a CIDR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError(String);

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CidrError {}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| CidrError(format!("{s:?} is not a CIDR ({why})"));
        let (ip, len) = s.split_once('/').ok_or_else(|| bad("no /length"))?;
        let net = canonical(ip.parse::<IpAddr>().map_err(|_| bad("not an IP address"))?);
        let len: u8 = len.parse().map_err(|_| bad("length not a number"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        if len > max {
            return Err(bad("length too long"));
        }
        let cidr = Self { net, len };
        if cidr.masked(net) != net {
            return Err(bad("host bits set"));
        }
        Ok(cidr)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.net, self.len)
    }
}

impl Cidr {
    /// `ip` with the bits past this network's length cleared.
    fn masked(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                IpAddr::V4((u32::from(v4) & mask).into())
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(v6) & mask).into())
            }
        }
    }

    /// True when `ip` (in any spelling, see [`canonical`]) is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        ip.is_ipv4() == self.net.is_ipv4() && self.masked(ip) == self.net
    }
}

/// True when `ip` is judged under `pod_cidrs`: no networks given (every IP
/// is), or inside one of them. The filter and the audit both ask this.
pub fn in_scope(pod_cidrs: &[Cidr], ip: IpAddr) -> bool {
    pod_cidrs.is_empty() || pod_cidrs.iter().any(|c| c.contains(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cidr_holds_its_addresses_in_either_spelling_and_nothing_else() {
        let pods: Cidr = "10.244.0.0/16".parse().unwrap();
        assert!(pods.contains(ip("10.244.3.7")));
        assert!(pods.contains(ip("::ffff:10.244.3.7")));
        assert!(!pods.contains(ip("10.245.0.1")));
        assert!(!pods.contains(ip("fd00::1")));
        let v6: Cidr = "fd00:10:244::/56".parse().unwrap();
        assert!(v6.contains(ip("fd00:10:244:ff::1")));
        assert!(!v6.contains(ip("fd00:10:245::1")));
        assert!(!v6.contains(ip("10.244.0.1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("192.0.2.1")));
        let one: Cidr = "192.0.2.1/32".parse().unwrap();
        assert!(one.contains(ip("192.0.2.1")) && !one.contains(ip("192.0.2.2")));
        assert_eq!(pods.to_string(), "10.244.0.0/16");
        assert!(in_scope(&[], ip("192.0.2.1")));
        assert!(in_scope(&[one, pods], ip("10.244.0.9")));
        assert!(!in_scope(&[one, pods], ip("192.0.2.9")));
        for bad in [
            "10.244.0.0",
            "10.244.0.1/16",
            "10.244.0.0/33",
            "x/8",
            "10.0.0.0/x",
            "::/129",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn mapped_addresses_become_ipv4_and_nothing_else_changes() {
        assert_eq!(canonical(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(canonical(ip("::FFFF:0a00:0007")), ip("10.0.0.7"));
        for same in [
            "10.0.0.7",
            "fd00::7",
            "::1",
            "::",
            "::10.0.0.7",
            "64:ff9b::a00:7",
        ] {
            assert_eq!(canonical(ip(same)), ip(same), "{same}");
        }
    }
}
