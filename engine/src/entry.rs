//! An index entry as a reader sees it: present for the current load, absent,
//! or corrupt. Every entry in shared data carries the load (full snapshot)
//! that wrote it, and one older than `meta`'s load reads as absent (see
//! [`crate::store`]).

/// What an entry's value says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry<T> {
    /// Absent: never written, cleared, or from an older load.
    Absent,
    /// Present and valid for the current load.
    Present(T),
    /// Not decodable: the reader cannot judge.
    Corrupt,
}
