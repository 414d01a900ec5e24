//! The LRU contender (issue #36): what a user would pick instead of the limiter, and what
//! XDP-Firewall and most XDP limiters do. A hand-assembled XDP program keeps a GCRA
//! theoretical arrival time (a u64, ns) per IPv4 source in a kernel `LRU_HASH` (or
//! `LRU_PERCPU_HASH`) of 2^20 entries, keyed by the source address (u32):
//!
//! - a frame that is not Ethernet + IPv4 passes (fail open);
//! - a known source: `now = bpf_ktime_get_ns()`, `base = max(tat, now)`, `new = base +
//!   interval`; if `new - now > tolerance` the frame is dropped, else `new` is stored with a
//!   plain store (as XDP-Firewall does: two CPUs charging one source at once may lose one
//!   charge; no compare-and-swap) and the frame passes;
//! - a new source: `bpf_map_update_elem(key, now + interval, BPF_ANY)`, which evicts the least
//!   recently used entry when the map is full, and the frame passes.
//!
//! `tolerance = burst x interval`, so a source sends `burst` frames back to back, then one per
//! `interval` (`1e9 / rate` ns), as the limiter's rule with the same `rate` and `burst` allows.
//! Loaded with raw `bpf()` calls as [`crate::progs`]' programs are.

use std::{
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result};
use aya::programs::Xdp;

use crate::progs::{
    self, insn, ld_map_fd, Insn, ADD64_IMM, ADD64_REG, CALL, EXIT, FUNC_KTIME_GET_NS,
    FUNC_MAP_LOOKUP_ELEM, JEQ_IMM, JGT_REG, JNE_IMM, LDX_DW, LDX_H, LDX_W, LD_IMM64, MOV64_IMM,
    MOV64_REG, STX_DW, STX_W, XDP_DROP, XDP_PASS,
};

const SUB64_REG: u8 = 0x1f;
const FUNC_MAP_UPDATE_ELEM: i32 = 2;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
/// `BPF_NOEXIST`: an update that adds a key only.
const NOEXIST: u64 = 1;

/// Entries of the contender's map: the limiter's default store capacity, 2^20.
pub const ENTRIES: u32 = 1 << 20;

/// Which kernel map holds the sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `BPF_MAP_TYPE_LRU_HASH`: one value per source, shared by the CPUs.
    Shared,
    /// `BPF_MAP_TYPE_LRU_PERCPU_HASH`: a value per source and CPU (each CPU limits alone).
    PerCpu,
}

impl Kind {
    /// The results' key part: `kernel.<tag>.*`, `e2e.random.<tag>`.
    pub fn tag(self) -> &'static str {
        match self {
            Kind::Shared => "lru",
            Kind::PerCpu => "lru_percpu",
        }
    }

    fn map_type(self) -> u32 {
        match self {
            Kind::Shared => 9,
            Kind::PerCpu => 10,
        }
    }
}

/// A GCRA rule: `interval` ns between frames, `tolerance` ns of credit.
#[derive(Clone, Copy, Debug)]
pub struct Gcra {
    pub interval_ns: u64,
    pub tolerance_ns: u64,
}

impl Gcra {
    /// `rate` frames a second, bursts of `burst`.
    pub fn new(rate: u64, burst: u64) -> Self {
        let interval_ns = (1_000_000_000 / rate.max(1)).max(1);
        Self {
            interval_ns,
            tolerance_ns: interval_ns * burst.max(1),
        }
    }
}

/// `dst = imm` for a 64-bit immediate (two instruction slots).
fn ld_imm64(dst: u8, imm: u64) -> [Insn; 2] {
    #[expect(clippy::cast_possible_truncation, reason = "the two halves of imm")]
    let (lo, hi) = (imm as u32, (imm >> 32) as u32);
    [
        insn(LD_IMM64, dst, 0, 0, lo.cast_signed()),
        insn(0, 0, 0, 0, hi.cast_signed()),
    ]
}

/// A jump offset from the instruction at `from` to the one at `to`.
pub(crate) fn jump(from: usize, to: usize) -> i16 {
    i16::try_from(to.cast_signed() - from.cast_signed() - 1).expect("a short program")
}

/// Where [`source_opening`]'s two jumps to PASS are.
const OPENING_TO_PASS: [usize; 2] = [5, 7];

/// What every per-source program here reads first: `r6 = ctx`, the bounds check of Ethernet +
/// IPv4, the Ethernet type, and the IPv4 source in `r4`. A frame too short or not IPv4 goes to
/// PASS, whose place [`opening_to_pass`] writes into the two jumps once it is known.
pub(crate) fn source_opening() -> Vec<Insn> {
    vec![
        insn(MOV64_REG, 6, 1, 0, 0), // r6 = ctx
        insn(LDX_W, 2, 6, 0, 0),     // r2 = data
        insn(LDX_W, 3, 6, 4, 0),     // r3 = data_end
        insn(MOV64_REG, 4, 2, 0, 0),
        insn(ADD64_IMM, 4, 0, 0, 34),
        insn(JGT_REG, 4, 3, 0, 0),      // short of Ethernet + IPv4: PASS
        insn(LDX_H, 4, 2, 12, 0),       // the ethertype, as stored
        insn(JNE_IMM, 4, 0, 0, 0x0008), // not 0x0800 (IPv4, big-endian): PASS
        insn(LDX_W, 4, 2, progs::IP_SRC, 0),
    ]
}

/// Points the two jumps of `p`'s [`source_opening`] at instruction `pass`.
pub(crate) fn opening_to_pass(p: &mut [Insn], pass: usize) {
    let [short, not_v4] = OPENING_TO_PASS;
    p[short] = insn(JGT_REG, 4, 3, jump(short, pass), 0);
    p[not_v4] = insn(JNE_IMM, 4, 0, jump(not_v4, pass), 0x0008);
}

/// The contender's instructions over `map` (see the module's doc).
pub fn program(map: BorrowedFd<'_>, gcra: Gcra) -> Vec<Insn> {
    // Jumps to PASS, DROP and NEW are patched once their places are known.
    let mut p = source_opening();
    p.push(insn(STX_W, 10, 4, -4, 0)); // key = the source, at r10-4
    p.extend(ld_map_fd(1, map));
    p.extend([
        insn(MOV64_REG, 2, 10, 0, 0),
        insn(ADD64_IMM, 2, 0, 0, -4),
        insn(CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM),
    ]);
    let to_new = p.len();
    p.extend([
        insn(JEQ_IMM, 0, 0, 0, 0),   // no entry: NEW
        insn(MOV64_REG, 7, 0, 0, 0), // r7 = &tat
        insn(CALL, 0, 0, 0, FUNC_KTIME_GET_NS),
        insn(LDX_DW, 1, 7, 0, 0),  // r1 = tat
        insn(JGT_REG, 1, 0, 1, 0), // base = max(tat, now)
        insn(MOV64_REG, 1, 0, 0, 0),
    ]);
    p.extend(ld_imm64(2, gcra.interval_ns));
    p.extend([
        insn(ADD64_REG, 1, 2, 0, 0), // r1 = new tat
        insn(MOV64_REG, 3, 1, 0, 0),
        insn(SUB64_REG, 3, 0, 0, 0), // r3 = new - now
    ]);
    p.extend(ld_imm64(4, gcra.tolerance_ns));
    let to_drop = p.len();
    p.extend([
        insn(JGT_REG, 3, 4, 0, 0), // over the tolerance: DROP
        insn(STX_DW, 7, 1, 0, 0),  // tat = new
    ]);
    let pass = p.len();
    p.extend([insn(MOV64_IMM, 0, 0, 0, XDP_PASS), insn(EXIT, 0, 0, 0, 0)]);
    let drop = p.len();
    p.extend([insn(MOV64_IMM, 0, 0, 0, XDP_DROP), insn(EXIT, 0, 0, 0, 0)]);
    let new = p.len();
    p.push(insn(CALL, 0, 0, 0, FUNC_KTIME_GET_NS));
    p.extend(ld_imm64(2, gcra.interval_ns));
    p.extend([
        insn(ADD64_REG, 0, 2, 0, 0),
        insn(STX_DW, 10, 0, -16, 0), // value = now + interval, at r10-16
    ]);
    p.extend(ld_map_fd(1, map));
    p.extend([
        insn(MOV64_REG, 2, 10, 0, 0),
        insn(ADD64_IMM, 2, 0, 0, -4),
        insn(MOV64_REG, 3, 10, 0, 0),
        insn(ADD64_IMM, 3, 0, 0, -16),
        insn(MOV64_IMM, 4, 0, 0, 0), // BPF_ANY
        insn(CALL, 0, 0, 0, FUNC_MAP_UPDATE_ELEM),
        insn(MOV64_IMM, 0, 0, 0, XDP_PASS),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    opening_to_pass(&mut p, pass);
    p[to_new] = insn(JEQ_IMM, 0, 0, jump(to_new, new), 0);
    p[to_drop] = insn(JGT_REG, 3, 4, jump(to_drop, drop), 0);
    p
}

/// The contender loaded: its map and its program.
pub struct Lru {
    pub kind: Kind,
    pub map: OwnedFd,
    pub program: Xdp,
    /// Bytes of a value as the syscalls see it (one u64, or one per possible CPU).
    value_size: usize,
}

impl Lru {
    /// A map of `entries` and the program over it, loaded as `name` (pinned in `pin_dir` for a
    /// moment, see [`progs::load`]).
    pub fn new(name: &str, kind: Kind, entries: u32, gcra: Gcra, pin_dir: &Path) -> Result<Self> {
        let map = progs::create_map(kind.map_type(), 4, 8, entries, 0)?;
        let program = progs::load(name, &program(map.as_fd(), gcra), pin_dir)?;
        let value_size = match kind {
            Kind::Shared => 8,
            Kind::PerCpu => {
                8 * aya::util::nr_cpus()
                    .map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))
                    .context("possible CPUs")?
            }
        };
        Ok(Self {
            kind,
            map,
            program,
            value_size,
        })
    }

    fn elem(&self, cmd: libc::c_long, key: [u8; 4], value: &mut [u8], flags: u64) -> Result<bool> {
        #[repr(C)]
        struct Elem {
            map_fd: u32,
            _pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        let attr = Elem {
            map_fd: u32::try_from(self.map.as_raw_fd()).expect("fd"),
            _pad: 0,
            key: key.as_ptr() as u64,
            value: if value.is_empty() {
                0
            } else {
                value.as_mut_ptr() as u64
            },
            flags,
        };
        match progs::sys_bpf(cmd, &attr) {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EEXIST)) => Ok(false),
            Err(e) => Err(e).context("a map element call on the LRU contender's map"),
        }
    }

    /// Adds `addr` with a TAT of 0 (a full burst) unless it is there; false if it was.
    pub fn add(&self, addr: [u8; 4]) -> Result<bool> {
        let mut value = vec![0u8; self.value_size];
        self.elem(BPF_MAP_UPDATE_ELEM, addr, &mut value, NOEXIST)
    }

    /// The TAT of `addr` (the latest of the CPUs', for the per-CPU map), if it is there. A
    /// lookup from user space leaves the entry's place in the LRU as it was.
    pub fn tat(&self, addr: [u8; 4]) -> Result<Option<u64>> {
        let mut value = vec![0u8; self.value_size];
        Ok(self
            .elem(BPF_MAP_LOOKUP_ELEM, addr, &mut value, 0)?
            .then(|| {
                value
                    .chunks_exact(8)
                    .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
                    .max()
                    .unwrap_or(0)
            }))
    }

    /// Removes `addr`; false if it was not there.
    pub fn remove(&self, addr: [u8; 4]) -> Result<bool> {
        self.elem(BPF_MAP_DELETE_ELEM, addr, &mut [], 0)
    }

    /// How many addresses of `addrs` are not there (lookups from user space, which leave the
    /// entries' places in the LRU as they were).
    pub fn count_missing(&self, addrs: &[[u8; 4]]) -> Result<u64> {
        let mut missing = 0;
        for &a in addrs {
            if self.tat(a)?.is_none() {
                missing += 1;
            }
        }
        Ok(missing)
    }

    /// Adds every address of `addrs` that is not there (see [`Lru::add`]); returns how many.
    pub fn add_missing(&self, addrs: &[[u8; 4]]) -> Result<u64> {
        let mut added = 0;
        for &a in addrs {
            if self.tat(a)?.is_none() && self.add(a)? {
                added += 1;
            }
        }
        Ok(added)
    }
}

#[cfg(test)]
mod tests {
    use ratelimit_testbed::skip_unless_root;

    use super::*;
    use crate::kernel::{v4_frame, v6_frame};

    /// The contender limits: a source's second frame under a burst of 1 is dropped, a new
    /// source passes, what is not IPv4 (IPv6, a cut frame) passes; under the bench's rule (rate
    /// and burst 1e9) a known source passes run after run; a source's frame leaves its TAT in
    /// the map. Would catch a wrong jump, a wrong GCRA comparison or a map that is not written.
    #[test]
    fn the_lru_contender_drops_a_sources_excess_and_passes_a_new_source() {
        if skip_unless_root() {
            return;
        }
        let dir = crate::progs::TestPinDir::new("rlb-lru-test");
        // One CPU for every run: the per-CPU map's frames must meet the same CPU's value.
        crate::generator::pin_to_cpu(0).unwrap();
        let run = progs::verdict;
        let (pass, drop) = (XDP_PASS.cast_unsigned(), XDP_DROP.cast_unsigned());
        for kind in [Kind::Shared, Kind::PerCpu] {
            let strict = Lru::new("rlb_t_lru", kind, 64, Gcra::new(1, 1), &dir.0).unwrap();
            let (a, b) = ([10, 0, 0, 1], [10, 0, 0, 2]);
            assert_eq!(run(&strict.program, &v4_frame(a), 1), pass, "{kind:?}: new");
            assert!(strict.tat(a).unwrap().is_some(), "{kind:?}: a's TAT stored");
            assert_eq!(
                run(&strict.program, &v4_frame(a), 1),
                drop,
                "{kind:?}: excess"
            );
            assert_eq!(
                run(&strict.program, &v4_frame(b), 1),
                pass,
                "{kind:?}: new b"
            );
            assert_eq!(run(&strict.program, &v6_frame(), 1), pass, "{kind:?}: IPv6");
            let cut = &v4_frame(a)[..30];
            assert_eq!(run(&strict.program, cut, 1), pass, "{kind:?}: cut frame");
            // The bench's rule: a known source is never over its rate.
            let bench = Lru::new(
                "rlb_t_lru2",
                kind,
                64,
                Gcra::new(1_000_000_000, 1_000_000_000),
                &dir.0,
            )
            .unwrap();
            assert!(bench.add(a).unwrap());
            assert!(
                !bench.add(a).unwrap(),
                "{kind:?}: add refuses a present key"
            );
            assert_eq!(
                run(&bench.program, &v4_frame(a), 1000),
                pass,
                "{kind:?}: bench rule"
            );
            assert!(bench.tat(a).unwrap().unwrap() > 0, "{kind:?}: TAT charged");
            assert!(bench.remove(a).unwrap());
            assert!(bench.tat(a).unwrap().is_none());
        }
    }
}
