use std::collections::HashMap;

use proptest::prelude::*;

use super::{Key, Table};

/// A key whose hash puts it in one of four home slots whatever the table's
/// size: long runs that wrap round the end, and deletions inside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
struct Crowded(u8);

impl Key for Crowded {
    fn hash(self) -> u64 {
        // 0, 1/4, 1/2 and just short of the end of the table.
        [0, 1 << 62, 1 << 63, u64::MAX][usize::from(self.0 % 4)]
    }
}

#[derive(Debug, Clone)]
enum Op<K> {
    Insert(K, u32),
    Remove(K),
    Get(K),
    /// Keeps the values with this remainder when divided by 3.
    Retain(u32),
    Reserve(usize),
}

fn ops<K: std::fmt::Debug + Clone>(
    key: impl Strategy<Value = K> + Clone,
) -> impl Strategy<Value = Vec<Op<K>>> {
    let op = prop_oneof![
        4 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
        2 => key.clone().prop_map(Op::Remove),
        2 => key.prop_map(Op::Get),
        1 => (0u32..3).prop_map(Op::Retain),
        1 => (0usize..80).prop_map(Op::Reserve),
    ];
    prop::collection::vec(op, 0..300)
}

/// Runs `ops` on a table and on a std `HashMap`, and checks they agree
/// after each.
fn agree<K: Key + std::hash::Hash + std::fmt::Debug>(ops: Vec<Op<K>>) {
    let mut table: Table<K, u32> = Table::default();
    let mut model: HashMap<K, u32> = HashMap::new();
    for op in ops {
        match op {
            Op::Insert(k, v) => assert_eq!(table.insert(k, v), model.insert(k, v)),
            Op::Remove(k) => assert_eq!(table.remove(k), model.remove(&k)),
            Op::Get(k) => {
                assert_eq!(table.get(k), model.get(&k));
                if let Some(v) = table.get_mut(k) {
                    *v = v.wrapping_add(1);
                }
                if let Some(v) = model.get_mut(&k) {
                    *v = v.wrapping_add(1);
                }
            }
            Op::Retain(r) => {
                let mut asked = 0;
                table.retain(|v| {
                    asked += 1;
                    *v % 3 == r
                });
                assert_eq!(asked, model.len(), "each entry asked once");
                model.retain(|_, v| *v % 3 == r);
            }
            Op::Reserve(n) => {
                table.reserve(n);
                assert!(super::max_len(table.slots.len()) >= n);
            }
        }
        assert_eq!(table.len(), model.len());
        assert!(table.len() <= super::max_len(table.slots.len()));
        for (k, v) in &model {
            assert_eq!(table.get(*k), Some(v), "{k:?}");
        }
        let mut listed: Vec<(K, u32)> = table.iter().map(|(k, v)| (k, *v)).collect();
        assert_eq!(listed.len(), model.len());
        listed.retain(|(k, v)| model.get(k) == Some(v));
        assert_eq!(listed.len(), model.len(), "iter lists the model");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_table_agrees_with_a_hash_map_on_colliding_keys(ops in ops(any::<u8>().prop_map(Crowded))) {
        agree(ops);
    }

    #[test]
    fn the_table_agrees_with_a_hash_map_on_ipv4_keys(ops in ops(0u32..96)) {
        agree(ops);
    }

    #[test]
    fn the_table_agrees_with_a_hash_map_on_ipv6_keys(
        ops in ops((0u32..4, 0u32..48).prop_map(|(hi, lo)| [hi << 16, 0, 0, lo]))
    ) {
        agree(ops);
    }
}

#[test]
fn a_reserved_table_holds_an_ipv4_baseline_in_at_most_19_bytes_an_ip() {
    const IPS: u32 = 150_000;
    // The baseline's facts: 12 bytes.
    let mut table: Table<u32, [u32; 3]> = Table::default();
    table.reserve(IPS as usize);
    let reserved = table.allocated();
    for ip in 0..IPS {
        table.insert(0x0a00_0000 | ip, [ip; 3]);
    }
    assert_eq!(table.allocated(), reserved, "no growth after reserve");
    let per_ip = reserved as f64 / f64::from(IPS);
    // A std HashMap<u32, [u32; 3]> takes 262,144 slots of 17 bytes here
    // (about 29.7 an IP).
    assert!(per_ip <= 19.0, "{per_ip} bytes an IP");
    assert_eq!(table.get(0x0a00_0000 | 77), Some(&[77; 3]));
}
