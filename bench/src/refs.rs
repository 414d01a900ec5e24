//! The reference programs of the project's XDP object (`bench_pass`, `bench_drop`, `bench_tx`)
//! and the hand-assembled random-source generator, loaded once for the whole run.
//!
//! The object's maps are pinned by name, so loading it creates them under a pin directory of its
//! own (`/sys/fs/bpf/rl-bench-refs-<pid>`), with a bucket map of a few entries since none of these
//! programs touch it; the directory is removed on drop.

use std::{fs, path::PathBuf};

use anyhow::{Context as _, Result};
use aya::{
    programs::{xdp::XdpLinkId, Xdp, XdpMode},
    Ebpf, EbpfLoader,
};
use ratelimit::dataplane::object;
use ratelimit_common::map_names;
use ratelimit_testbed::{in_netns, Netns};

use crate::{
    generator::{load_known_source, load_random_source},
    lru::{Gcra, Kind, Lru},
};

/// `XDP_PASS` on every frame: the floor of the in-kernel cost, and a receiver that hands every
/// frame to the stack.
pub const PASS: &str = "bench_pass";
/// `XDP_DROP` on every frame: the end-to-end floor.
pub const DROP: &str = "bench_drop";
/// `XDP_TX` on every frame: the hot-source generator.
pub const TX: &str = "bench_tx";

/// The loaded reference programs.
pub struct Refs {
    ebpf: Option<Ebpf>,
    random: Option<Xdp>,
    known: Option<Xdp>,
    /// The LRU contenders loaded so far (end to end), at most one of each kind.
    lru: Vec<Lru>,
    dir: PathBuf,
}

impl Refs {
    /// Loads the three reference programs and the random-source generator.
    pub fn load() -> Result<Self> {
        let dir = PathBuf::from(format!("/sys/fs/bpf/rl-bench-refs-{}", std::process::id()));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // From here on, drop removes the directory.
        let mut refs = Self {
            ebpf: None,
            random: None,
            known: None,
            lru: Vec::new(),
            dir,
        };
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&refs.dir)
            .map_max_entries(map_names::BUCKETS, 64)
            .load(object())
            .context("loading the XDP object for its reference programs")?;
        for name in [PASS, DROP, TX] {
            let prog: &mut Xdp = ebpf
                .program_mut(name)
                .with_context(|| format!("no program {name} in the XDP object"))?
                .try_into()
                .with_context(|| format!("{name} is not an XDP program"))?;
            prog.load().with_context(|| format!("loading {name}"))?;
        }
        refs.ebpf = Some(ebpf);
        refs.random = Some(load_random_source(&refs.dir)?);
        refs.known = Some(load_known_source(&refs.dir)?);
        Ok(refs)
    }

    /// The pin directory (for programs loaded alongside, see [`crate::progs::load`]).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Reference program `name`.
    pub fn program(&self, name: &str) -> &Xdp {
        self.ebpf
            .as_ref()
            .expect("loaded")
            .program(name)
            .expect("loaded in Refs::load")
            .try_into()
            .expect("an XDP program")
    }

    /// The random-source generator.
    pub fn random(&self) -> &Xdp {
        self.random.as_ref().expect("loaded")
    }

    /// The known-source generator (2^19 sources, see [`crate::generator::KNOWN_BITS`]).
    pub fn known(&self) -> &Xdp {
        self.known.as_ref().expect("loaded")
    }

    /// Attaches reference program `name` to `iface` of `ns` in native (driver) mode.
    pub fn attach(&mut self, name: &str, ns: &Netns, iface: &str) -> Result<XdpLinkId> {
        let prog: &mut Xdp = self
            .ebpf
            .as_mut()
            .expect("loaded")
            .program_mut(name)
            .expect("loaded in Refs::load")
            .try_into()
            .expect("an XDP program");
        // Attaching looks the interface up in the calling thread's namespace.
        in_netns(ns, || prog.attach(iface, XdpMode::Driver))
            .with_context(|| format!("attaching {name} to {iface} (native XDP)"))
    }

    /// The LRU contender `kind` (see [`crate::lru`]), loaded with `entries` and `gcra` the
    /// first time it is asked for; later calls get the same one, its map as it was left.
    pub fn lru(&mut self, kind: Kind, entries: u32, gcra: Gcra) -> Result<&mut Lru> {
        if !self.lru.iter().any(|l| l.kind == kind) {
            let name = format!("rlb_e2e_{}", kind.tag());
            let lru = Lru::new(&name, kind, entries, gcra, &self.dir)?;
            self.lru.push(lru);
        }
        Ok(self
            .lru
            .iter_mut()
            .find(|l| l.kind == kind)
            .expect("loaded above"))
    }

    /// Unloads the LRU contenders: the next [`Refs::lru`] makes an empty map.
    pub fn unload_lrus(&mut self) {
        self.lru.clear();
    }

    /// Detaches what [`Refs::attach`] attached.
    pub fn detach(&mut self, name: &str, link: XdpLinkId) -> Result<()> {
        let prog: &mut Xdp = self
            .ebpf
            .as_mut()
            .expect("loaded")
            .program_mut(name)
            .expect("loaded in Refs::load")
            .try_into()
            .expect("an XDP program");
        prog.detach(link)
            .with_context(|| format!("detaching {name}"))
    }
}

impl Drop for Refs {
    fn drop(&mut self) {
        self.random = None;
        self.known = None;
        self.lru.clear();
        self.ebpf = None;
        if let Ok(entries) = fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let _ = fs::remove_file(entry.path());
            }
        }
        if let Err(e) = fs::remove_dir(&self.dir) {
            eprintln!("ratelimit-bench: cannot remove {}: {e}", self.dir.display());
        }
    }
}
