//! The one canonical form of an IP address, for validator and filter alike.
//!
//! Kubernetes, Envoy and the kernel can all spell an IPv4 address as an
//! IPv4-mapped IPv6 address (`::ffff:10.0.0.7`). The index keys IPs by their
//! canonical form, so both sides must map an address the same way before they
//! look it up: one rule, one place.

use std::net::IpAddr;

/// IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) become the IPv4 address; every
/// other address is already canonical. (IPv4-*compatible* addresses, `::a.b.c.d`,
/// are deprecated and stay IPv6, as the standard library reads them.)
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
