//! Types shared by the ratelimit XDP program and its user-space agent.
//!
//! Everything that crosses the kernel/user boundary lives here: map names and capacities, map keys
//! and values, rule records and counters. Every type is `#[repr(C)]` with explicit padding so both
//! sides agree on the layout byte for byte; a `const` assertion pins each size. [`share`] holds
//! the arithmetic of a cluster-scoped bucket at a share, which the program charges with and the
//! agent converts with.
#![no_std]
#![deny(missing_docs)]

// One file per concept; every item is re-exported here, at the paths both sides name it by.
mod clock;
mod costs;
mod counters;
mod first;
mod flags;
mod frag;
mod maps;
mod new_pages;
mod records;
mod store;
mod tags;

/// The layout of everything pinned, as one number stored in the pins ([`Config::layout`]): a
/// version of ratelimit adopts pinned state only if it was created with the same stamp.
///
/// The stamp is derived at compile time from the size, alignment and field offsets of every
/// pinned record type, the number of counters, and each pinned map's type and flags; so a
/// change of any of them (even one that keeps a record's size, such as two fields swapped)
/// changes it. [`layout::EPOCH`] covers what the layout cannot show: bump it when the meaning of
/// a pinned field, counter index or flag changes.
pub mod layout;
pub mod share;
/// The IPv4 table ([`map_names::V4_TABLE`]): a direct index of the prefix trie's outcomes by
/// /16, one `u32` word per /16 and trie half.
///
/// A word other than [`TRIE`](v4_table::TRIE) holds the whole classification of every source of
/// its /16 under that half: no prefix longer than /16 lies inside the /16, and the longest prefix
/// that covers it (if any) has a first candidate rule that looks at neither protocol, port nor
/// TCP flags, so the candidate walk stops there for every packet. Any other /16 holds
/// [`TRIE`](v4_table::TRIE): the program looks in the trie, as it did before the table. A table
/// never written (zeroes) is therefore always right, only slower.
pub mod v4_table;

pub use clock::*;
pub use costs::*;
pub use counters::*;
pub use first::*;
pub use flags::*;
pub use frag::*;
pub use maps::*;
pub use new_pages::*;
pub use records::*;
pub use store::*;
pub use tags::*;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)], Copy, contain only integers and have no implicit
    // padding (checked by the size assertion beside each type).
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PrefixKey {}
    unsafe impl aya::Pod for super::RuleSet {}
    unsafe impl aya::Pod for super::Rule {}
    unsafe impl aya::Pod for super::Limit {}
    unsafe impl aya::Pod for super::BucketKey {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::RuleStats {}
    unsafe impl aya::Pod for super::GlobalStats {}
    unsafe impl aya::Pod for super::RuleMeta {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::FragEntry {}
}
