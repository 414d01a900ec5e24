//! The reference programs of the project's XDP object (`bench_pass`, `bench_drop`, `bench_tx`),
//! the hand-assembled read-then-drop floor ([`READ_DROP`]) and random-source generator, loaded
//! once for the whole run.
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
    lru::{self, Gcra, Kind, Lru},
    progs::{self, insn, Insn, EXIT, JEQ_IMM, MOV64_IMM, XDP_DROP, XDP_PASS},
};

/// `XDP_PASS` on every frame: the floor of the in-kernel cost, and a receiver that hands every
/// frame to the stack.
pub const PASS: &str = "bench_pass";
/// `XDP_DROP` on every frame: the end-to-end floor.
pub const DROP: &str = "bench_drop";
/// `XDP_TX` on every frame: the hot-source generator.
pub const TX: &str = "bench_tx";
/// Reads the frame's Ethernet type and IPv4 source, then `XDP_DROP` (`XDP_PASS` for a frame too
/// short for them or not IPv4, or from 0.0.0.0, so the read decides): the end-to-end floor of any
/// program that limits by source, which [`DROP`] is not (it never touches the frame's data).
pub const READ_DROP: &str = "rlb_read_drop";

/// The loaded reference programs.
pub struct Refs {
    ebpf: Option<Ebpf>,
    random: Option<Xdp>,
    known: Option<Xdp>,
    read_drop: Option<Xdp>,
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
            read_drop: None,
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
        refs.read_drop = Some(progs::load(READ_DROP, &read_drop_program(), &refs.dir)?);
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
        let prog = self.program_mut(name);
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
        self.program_mut(name)
            .detach(link)
            .with_context(|| format!("detaching {name}"))
    }

    /// Reference program `name`, to attach or detach: [`READ_DROP`] or one of the object's.
    fn program_mut(&mut self, name: &str) -> &mut Xdp {
        if name == READ_DROP {
            return self.read_drop.as_mut().expect("loaded in Refs::load");
        }
        self.ebpf
            .as_mut()
            .expect("loaded")
            .program_mut(name)
            .expect("loaded in Refs::load")
            .try_into()
            .expect("an XDP program")
    }
}

/// [`READ_DROP`]'s instructions: the LRU contender's opening (`lru::source_opening`, what
/// every per-source limiter reads first), then the verdict, with nothing else.
fn read_drop_program() -> Vec<Insn> {
    let mut p = lru::source_opening();
    let to_pass = p.len();
    p.extend([
        insn(JEQ_IMM, 4, 0, 0, 0), // from 0.0.0.0: PASS
        insn(MOV64_IMM, 0, 0, 0, XDP_DROP),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    let pass = p.len();
    p.extend([insn(MOV64_IMM, 0, 0, 0, XDP_PASS), insn(EXIT, 0, 0, 0, 0)]);
    p[to_pass] = insn(JEQ_IMM, 4, 0, lru::jump(to_pass, pass), 0);
    lru::opening_to_pass(&mut p, pass);
    p
}

impl Drop for Refs {
    fn drop(&mut self) {
        self.random = None;
        self.known = None;
        self.read_drop = None;
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

#[cfg(test)]
mod tests {
    use ratelimit_testbed::skip_unless_root;

    use super::*;
    use crate::kernel::{v4_frame, v6_frame};

    /// The read-drop floor drops an IPv4 frame and passes what it cannot read a source from (a
    /// cut frame, IPv6) and a frame from 0.0.0.0: its verdict hangs on the bytes it read, so
    /// the read is in every run. Would catch a wrong jump or offset.
    #[test]
    fn the_read_drop_floor_drops_by_what_it_read() {
        if skip_unless_root() {
            return;
        }
        let dir = progs::TestPinDir::new("rlb-read-drop-test");
        let prog = progs::load("rlb_t_read_drop", &read_drop_program(), &dir.0).unwrap();
        let run = |frame: &[u8]| progs::verdict(&prog, frame, 1);
        let (pass, drop) = (XDP_PASS.cast_unsigned(), XDP_DROP.cast_unsigned());
        assert_eq!(run(&v4_frame([10, 0, 0, 1])), drop, "an IPv4 frame");
        assert_eq!(run(&v4_frame([0, 0, 0, 0])), pass, "from 0.0.0.0");
        assert_eq!(run(&v4_frame([10, 0, 0, 1])[..33]), pass, "cut short");
        assert_eq!(run(&v6_frame()), pass, "IPv6");
    }
}
