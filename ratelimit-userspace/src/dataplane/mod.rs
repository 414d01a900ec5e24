//! The data plane: loads the XDP program with its maps pinned under bpffs, attaches it to
//! interfaces, swaps rule sets in atomically and reads the counters back.
//!
//! A rule set is installed under the inactive *generation* of the prefix trie and then made live by
//! flipping one word in the config map, so a packet sees either the old set or the new one whole.
//!
//! One file per concept:
//! - this file: [`Dataplane`] and the types of its API ([`LoadOptions`], [`Attachment`],
//!   [`LinkHealth`], [`DataplaneError`]), and the embedded XDP object;
//! - `attach.rs`: loading the program (and seeding the bucket store), attaching it to interfaces
//!   through pinned links, detaching, removing it all;
//! - `install.rs`: installing a rule set (the rule records, both generations of the prefix trie,
//!   the switch between them);
//! - `pins.rs`: the pin directory made the agent's own and locked (what else is found there is
//!   moved aside), through `*at` system calls; removing pins;
//! - `bpffs.rs`: the bpffs mount that holds the pins;
//! - `netdev.rs`: interfaces: whether one exists, its index, ethtool commands on it.

mod attach;
mod bpffs;
mod install;
mod netdev;
mod pins;

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{programs::links::FdLink, Ebpf};
use ratelimit_common::RuleSet;

pub use crate::config::AttachMode;
use crate::maps::{MapsError, PinnedMaps};
use install::{IdSet, MirrorKey, Written};
pub use netdev::{ethtool_value, gro_enabled, ifindex, interface_exists};
pub use pins::{check_own_pin_dir, remove_link_pins, remove_pin_dir};

/// The compiled XDP object, built by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ratelimit.bpf.o"));

/// The compiled XDP object (for benchmarks that load its reference programs `bench_pass`,
/// `bench_drop` and `bench_tx`).
#[must_use]
pub fn object() -> &'static [u8] {
    OBJECT
}

/// Errors from loading, attaching or updating the data plane.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The binary was built without the XDP object (`RATELIMIT_EBPF_SKIP=1`).
    #[error("this binary was built without the XDP program (RATELIMIT_EBPF_SKIP=1); rebuild with `cargo xtask build`")]
    NoObject,
    /// bpffs is not mounted where the pin directory lives and could not be mounted.
    #[error("bpffs is not mounted at {path} and mounting it failed: {source}")]
    Bpffs {
        /// Mount point tried.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// Another agent (or a process acting for one) holds the pin directory.
    #[error(
        "pin directory {0} is in use by another running agent: stop it first, or give this one \
         another `pin_path` in [agent]"
    )]
    PinDirBusy(PathBuf),
    /// A file system operation on the pin directory failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// Opening, checking or updating the pinned maps failed.
    #[error(transparent)]
    Maps(#[from] MapsError),
    /// Loading the object or the program into the kernel failed.
    #[error("loading the XDP program: {0}")]
    Load(String),
    /// The interface does not exist.
    #[error("interface {0:?} does not exist")]
    NoSuchInterface(String),
    /// Attaching to an interface failed.
    #[error("attaching XDP to {iface} in {mode} mode: {reason}")]
    Attach {
        /// Interface name.
        iface: String,
        /// Mode tried.
        mode: &'static str,
        /// Kernel or aya error.
        reason: String,
    },
}

type Result<T, E = DataplaneError> = std::result::Result<T, E>;

/// One interface the program is attached to, through a bpf_link pinned at `pin_dir/link_<iface>`
/// so the attachment outlives the agent process (crash, or exit with `--keep-attached`).
#[derive(Debug)]
pub struct Attachment {
    /// Interface name.
    pub iface: String,
    /// The mode that took: "native" or "skb" (or "adopted" for a link a previous agent pinned).
    pub mode: &'static str,
    /// The interface's index when the program was attached: an interface deleted and created
    /// anew under the same name gets another one (see [`Dataplane::link_health`]).
    pub ifindex: u32,
    link: FdLink,
    pin: PathBuf,
}

/// Whether an attachment's interface is still the one the program was attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkHealth {
    /// It is.
    Attached,
    /// No interface has the name any more: it was deleted, and the kernel detached the program
    /// with it (the pinned link remains, defunct).
    Missing,
    /// An interface of that name exists, but it is another one (deleted and created again): the
    /// program is not attached to it.
    Replaced,
}

/// File name of the pinned link for `iface` inside the pin directory.
#[must_use]
pub fn link_pin_name(iface: &str) -> String {
    format!("link_{iface}")
}

/// What [`Dataplane::load`] needs.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Directory under bpffs for the pinned maps.
    pub pin_dir: PathBuf,
    /// Capacity of the bucket map.
    pub max_buckets: u32,
    /// A compiled XDP object to load instead of the one built in (`None` for the agent): the
    /// tests' build variants of the program (ratelimit-ebpf's test-only features).
    pub object: Option<PathBuf>,
}

/// The loaded program, its maps and its attachments.
pub struct Dataplane {
    ebpf: Ebpf,
    maps: PinnedMaps,
    attachments: Vec<Attachment>,
    /// Rule ids named in the rule set in force.
    live_ids: IdSet,
    /// What this data plane wrote to each rule record it knows (the record with its bucket
    /// generation, the name and the config line), indexed by rule id, so an install rewrites
    /// only what changed. Empty after an adoption: the first install writes every record.
    records: Vec<Option<Written>>,
    /// The prefix entries both generations of the trie hold, sorted by [`MirrorKey`], when they
    /// hold the same, known set: an install then writes only the difference, into each
    /// generation in turn. `None` until known (after an adoption, or while an install that may
    /// fail half-way is writing): the next install clears and rewrites both.
    mirror: Option<Vec<(MirrorKey, RuleSet)>>,
    /// The program's `internal` counter when the last install began: when it has moved by the
    /// next, the program met a state the agent never writes (see [`Dataplane::install`]).
    internal_at_install: Option<u64>,
    /// The exclusive lock on the pin directory (see [`prepare_pin_dir`](pins::prepare_pin_dir)),
    /// held until the data plane is dropped or removed.
    lock: fs::File,
}

impl Dataplane {
    /// The pin directory.
    #[must_use]
    pub fn pin_dir(&self) -> &Path {
        self.maps.dir()
    }

    /// The pinned maps.
    #[must_use]
    pub fn maps(&self) -> &PinnedMaps {
        &self.maps
    }

    /// Interfaces the program is attached to.
    #[must_use]
    pub fn attachments(&self) -> &[Attachment] {
        &self.attachments
    }

    /// The loaded object.
    #[must_use]
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    /// Mutable access to the loaded object (for the aya-log reader).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The XDP program calls none of the memory builtins. Each is a byte loop behind a BPF call,
    /// and under the kernel's return-stack mitigations every BPF call's return is costly. The
    /// compiler emits them for whole-struct copies and runs of constant stores. With 11 `memset`
    /// calls a new source's first packet cost 60-80 ns more (docs/journal.md, *A new source's
    /// packet without library calls*); one `memmove` from a copied array came back unnoticed
    /// once. Write such stores field by field (see `scratch::empty_slot` in the eBPF crate).
    #[test]
    fn the_xdp_program_calls_no_memory_builtin() {
        use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget};
        let file = object::File::parse(OBJECT).expect("the embedded XDP object parses");
        let builtins = ["memset", "memcpy", "memmove", "memcmp", "bcmp"];
        let mut calls = Vec::new();
        let mut code = 0;
        for section in file
            .sections()
            .filter(|s| s.kind() == object::SectionKind::Text)
        {
            code += 1;
            for (offset, reloc) in section.relocations() {
                let RelocationTarget::Symbol(i) = reloc.target() else {
                    continue;
                };
                let name = file
                    .symbol_by_index(i)
                    .ok()
                    .and_then(|s| s.name().ok().map(str::to_owned))
                    .unwrap_or_default();
                if builtins.contains(&name.as_str()) {
                    calls.push(format!(
                        "{name} called at {}+{offset:#x}",
                        section.name().unwrap_or("?")
                    ));
                }
            }
        }
        assert!(code >= 2, "no code sections found (xdp and .text)");
        assert!(
            calls.is_empty(),
            "the XDP program calls memory builtins (see this test's doc): {calls:#?}"
        );
    }
}
