//! Hand-assembled XDP programs for the benchmark, loaded with raw `bpf()` calls and then opened
//! through aya (pinned for a moment), so they run with the same `TestRun` as the project's own.
//!
//! They stay out of the project's XDP object on purpose: the benchmark must not change the
//! program it measures. Each is a handful of instructions:
//! - the random-source generator (see [`crate::generator`]);
//! - *drivers* that rewrite a frame's source address and then tail-call another program (the
//!   limiter, or `bench_pass` as the floor), so that BPF_PROG_TEST_RUN with `repeat` sees a new
//!   source on every run: the frame buffer is shared by the runs of one call, so each run finds
//!   the previous run's address;
//! - *probes* that do one thing the limiter does (read a clock, look up a map, e.g. the bucket
//!   store's record of a source) and pass, to weigh the parts of its fast path.

use std::{
    ffi::CString,
    fs,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{bail, Context as _, Result};
use aya::programs::Xdp;

mod maps;

pub use self::maps::{
    create_map, prog_array, read_mapped, turn_array, turn_array_warm, write_mapped, F_MMAPABLE,
    MAP_ARRAY,
};
use self::maps::{create_map_of, update_elem};

// BPF instruction encoding (include/uapi/linux/bpf.h).
pub const MOV64_REG: u8 = 0xbf;
pub const MOV64_IMM: u8 = 0xb7;
pub const ADD64_IMM: u8 = 0x07;
pub const ADD64_REG: u8 = 0x0f;
pub const AND64_IMM: u8 = 0x57;
pub const RSH64_IMM: u8 = 0x77;
pub const XOR64_IMM: u8 = 0xa7;
pub const MOD64_IMM: u8 = 0x97;
pub const MUL64_IMM: u8 = 0x27;
pub const STX_DW: u8 = 0x7b;
/// `BPF_STX | BPF_ATOMIC | BPF_DW`; with `imm = 0` (`BPF_ADD`), a locked add of `src` to the
/// word at `dst + off`.
pub const ATOMIC_DW: u8 = 0xdb;
pub const TO_BE: u8 = 0xdc;
pub const LDX_W: u8 = 0x61;
pub const LDX_H: u8 = 0x69;
pub const LSH64_IMM: u8 = 0x67;
pub const LDX_DW: u8 = 0x79;
pub const STX_B: u8 = 0x73;
pub const STX_W: u8 = 0x63;
pub const ST_B: u8 = 0x72;
pub const JGT_REG: u8 = 0x2d;
pub const JEQ_IMM: u8 = 0x15;
pub const JNE_IMM: u8 = 0x55;
pub const LD_IMM64: u8 = 0x18;
pub const CALL: u8 = 0x85;
pub const EXIT: u8 = 0x95;
/// `src_reg` of an `LD_IMM64` whose immediate is a map fd.
const PSEUDO_MAP_FD: u8 = 1;

pub const FUNC_MAP_LOOKUP_ELEM: i32 = 1;
pub const FUNC_KTIME_GET_NS: i32 = 5;
pub const FUNC_GET_PRANDOM_U32: i32 = 7;
pub const FUNC_TAIL_CALL: i32 = 12;
pub const FUNC_KTIME_GET_COARSE_NS: i32 = 160;
pub const FUNC_JIFFIES64: i32 = 118;

pub const XDP_ABORTED: i32 = 0;
pub const XDP_DROP: i32 = 1;
pub const XDP_PASS: i32 = 2;
pub const XDP_TX: i32 = 3;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// aya loads XDP programs with this expected attach type; a tail call needs both sides to agree.
const BPF_XDP: u32 = 37;

/// One instruction.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

/// An instruction: opcode, destination and source registers, offset, immediate.
pub const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// `dst = map fd` (two instruction slots).
pub fn ld_map_fd(dst: u8, fd: BorrowedFd<'_>) -> [Insn; 2] {
    [
        insn(LD_IMM64, dst, PSEUDO_MAP_FD, 0, fd.as_raw_fd()),
        insn(0, 0, 0, 0, 0),
    ]
}

pub(crate) fn sys_bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<i64> {
    // SAFETY: `attr` is a valid prefix of union bpf_attr for `cmd` (each caller's struct follows
    // the uapi layout); every pointer in it points at memory that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(attr),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

pub(crate) fn owned(fd: i64) -> OwnedFd {
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).expect("an fd")) }
}

/// Loads `insns` as an XDP program named `name` and opens it through aya, pinning it in
/// `pin_dir` just long enough for that.
pub fn load(name: &str, insns: &[Insn], pin_dir: &Path) -> Result<Xdp> {
    let license = CString::new("Dual MIT/GPL").expect("no NUL");
    let mut log = vec![0u8; 64 * 1024];
    // union bpf_attr, BPF_PROG_LOAD member, up to `expected_attach_type`.
    #[repr(C)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
        prog_ifindex: u32,
        expected_attach_type: u32,
    }
    let mut prog_name = [0u8; 16];
    let n = name.len().min(15);
    prog_name[..n].copy_from_slice(&name.as_bytes()[..n]);
    let attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: u32::try_from(insns.len()).context("program length")?,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: u32::try_from(log.len()).expect("64 KiB"),
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name,
        prog_ifindex: 0,
        expected_attach_type: BPF_XDP,
    };
    let fd = match sys_bpf(BPF_PROG_LOAD, &attr) {
        Ok(fd) => owned(fd),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            bail!(
                "loading {name}: {e}\n{}",
                String::from_utf8_lossy(&log[..end])
            );
        }
    };
    let pin = pin_dir.join(name);
    let path = CString::new(pin.to_string_lossy().as_bytes()).context("pin path")?;
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let attr = ObjPin {
        pathname: path.as_ptr() as u64,
        bpf_fd: u32::try_from(fd.as_raw_fd()).expect("fd"),
        file_flags: 0,
    };
    sys_bpf(BPF_OBJ_PIN, &attr).with_context(|| format!("pinning {name} at {}", pin.display()))?;
    let program = Xdp::from_pin(&pin, aya_obj::programs::XdpAttachType::Interface);
    let _ = fs::remove_file(&pin);
    program.with_context(|| format!("opening the pinned {name}"))
}

/// Offsets in an Ethernet + IPv4 frame.
pub const IP_ID: i16 = 14 + 4;
pub const IP_SRC: i16 = 14 + 12;

/// `r2 = data`, `r3 = data_end`, and a jump of `skip` instructions when the frame is shorter than
/// Ethernet + IPv4 (`ctx` in r6).
fn bounds(skip: i16) -> [Insn; 5] {
    [
        insn(LDX_W, 2, 6, 0, 0),
        insn(LDX_W, 3, 6, 4, 0),
        insn(MOV64_REG, 4, 2, 0, 0),
        insn(ADD64_IMM, 4, 0, 0, 34),
        insn(JGT_REG, 4, 3, skip, 0),
    ]
}

/// The random-source generator's instructions: 24 random bits into the last three bytes of the
/// IPv4 source address, the IP ID set so that the header checksum stays right, then `XDP_TX`.
pub fn random_source() -> Vec<Insn> {
    random_source_bits(24)
}

/// [`random_source`] with `bits` (16 to 24) random bits: the second byte of the address keeps
/// only its low `bits - 16`, so the sources are `2^bits` addresses, each sent again and again.
/// The checksum compensation adds whatever the bytes hold, masked or not.
pub fn random_source_bits(bits: u32) -> Vec<Insn> {
    assert!((16..=24).contains(&bits), "16 to 24 random bits");
    let b1_mask = (1i32 << (bits - 16)) - 1;
    let mut p = vec![
        insn(MOV64_REG, 6, 1, 0, 0),               // r6 = ctx
        insn(CALL, 0, 0, 0, FUNC_GET_PRANDOM_U32), // r0 = random
        insn(MOV64_REG, 7, 0, 0, 0),               // r7 = random
    ];
    let body = [
        insn(MOV64_REG, 5, 7, 0, 0), // r5 = b1 = random & 0xff
        insn(AND64_IMM, 5, 0, 0, b1_mask),
        insn(STX_B, 2, 5, IP_SRC + 1, 0), // src[1] = b1
        insn(MOV64_REG, 8, 7, 0, 0),      // r8 = b2b3 = (random >> 8) & 0xffff
        insn(RSH64_IMM, 8, 0, 0, 8),
        insn(AND64_IMM, 8, 0, 0, 0xffff),
        insn(MOV64_REG, 9, 8, 0, 0), // src[2] = b2b3 >> 8
        insn(RSH64_IMM, 9, 0, 0, 8),
        insn(STX_B, 2, 9, IP_SRC + 2, 0),
        insn(STX_B, 2, 8, IP_SRC + 3, 0), // src[3] = b2b3 & 0xff
        insn(ADD64_REG, 5, 8, 0, 0),      // s = b1 + b2b3, folded to 16 bits
        insn(MOV64_REG, 9, 5, 0, 0),
        insn(RSH64_IMM, 9, 0, 0, 16),
        insn(AND64_IMM, 5, 0, 0, 0xffff),
        insn(ADD64_REG, 5, 9, 0, 0),
        insn(XOR64_IMM, 5, 0, 0, 0xffff), // id = !s
        insn(MOV64_REG, 9, 5, 0, 0),
        insn(RSH64_IMM, 9, 0, 0, 8),
        insn(STX_B, 2, 9, IP_ID, 0), // id, big-endian
        insn(STX_B, 2, 5, IP_ID + 1, 0),
    ];
    p.extend(bounds(i16::try_from(body.len()).expect("short")));
    p.extend(body);
    p.extend([insn(MOV64_IMM, 0, 0, 0, XDP_TX), insn(EXIT, 0, 0, 0, 0)]);
    p
}

/// The frame's IPv4 source plus one (data in r2).
const NEXT_SOURCE: [Insn; 5] = [
    insn(LDX_W, 5, 2, IP_SRC, 0), // r5 = src as stored (network order)
    insn(TO_BE, 5, 0, 0, 32),     // to a number
    insn(ADD64_IMM, 5, 0, 0, 1),
    insn(TO_BE, 5, 0, 0, 32), // back to network order
    insn(STX_W, 2, 5, IP_SRC, 0),
];

/// How a driver picks the next source.
#[derive(Clone, Copy, Debug)]
pub enum Sources<'a> {
    /// The previous run's address plus one: a source never seen before on every run.
    Sequential,
    /// The `n` IPv4 addresses (4 bytes each, as in the header) of an array made by
    /// [`turn_array`], one after the other (entry `n` holds the next one's index): stored in a
    /// random order, so each run's source is a random one of the `n`, and read in order, so the
    /// read is a stream the CPU prefetches. A random draw (entry `random % n`) missed the cache
    /// on a 4 MiB array at 1M sources, and the program under test waited for that miss before
    /// its own reads began, where the driver's floor (nothing waits for the address) overlapped
    /// it: a miss the driver's, counted as the program's.
    InTurn(BorrowedFd<'a>, u32),
    /// As `InTurn`, from an array made by [`turn_array_warm`], and before it hands the source
    /// on, the driver reads the eight records of the source's key in the store (the third
    /// field), the new source waiting for them: the program it calls finds its records in the
    /// cache. Its figure less the same driver's before `XDP_PASS` is the program's work with its
    /// records cached, plus the part of the driver's reads it waits for (before `XDP_PASS`
    /// nothing waits for them, and consecutive runs' reads overlap).
    InTurnWarm(BorrowedFd<'a>, u32, BorrowedFd<'a>),
}

/// `r0` = the entry of the map in r1 whose u32 key is at r10-4, or an `XDP_ABORTED` exit if there
/// is none (which cannot happen for an array map and a key below its size).
const LOOKUP_AT_FP4: [Insn; 6] = [
    insn(MOV64_REG, 2, 10, 0, 0),
    insn(ADD64_IMM, 2, 0, 0, -4),
    insn(CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM),
    insn(JNE_IMM, 0, 0, 2, 0),
    insn(MOV64_IMM, 0, 0, 0, XDP_ABORTED),
    insn(EXIT, 0, 0, 0, 0),
];

/// `r0` = the entry of `map` whose u32 key is at r10-4 (see [`LOOKUP_AT_FP4`]).
pub(crate) fn entry_at_fp4(map: BorrowedFd<'_>) -> Vec<Insn> {
    let mut p = ld_map_fd(1, map).to_vec();
    p.extend(LOOKUP_AT_FP4);
    p
}

/// `r0` = entry `random % n` of the array map (see [`entry_at_fp4`]).
fn random_entry(map: BorrowedFd<'_>, n: u32) -> Vec<Insn> {
    let mut p = vec![
        insn(CALL, 0, 0, 0, FUNC_GET_PRANDOM_U32),
        insn(MOD64_IMM, 0, 0, 0, i32::try_from(n).expect("n < 2^31")),
        insn(STX_W, 10, 0, -4, 0), // key = random % n, at r10-4
    ];
    p.extend(entry_at_fp4(map));
    p
}

/// What a driver reads of the bucket store (an array map of `n` records) before it rewrites the
/// source: the memory a limiter's packet cannot do without, with none of the limiter's work.
#[derive(Clone, Copy, Debug)]
pub enum Touch<'a> {
    /// One random record (entry `random % n`): the record of a known source, wherever the keyed
    /// hash puts it.
    Record(BorrowedFd<'a>, u32),
    /// The eight records a new key's packet reads before it knows the key has none: two random
    /// sets of four records in one random group of 8 sets of a random page (as
    /// `ratelimit_common::bucket_sets` places a key's two sets), eight independent loads.
    Candidates(BorrowedFd<'a>, u32),
    /// As `Candidates`, then one locked add (of zero) to the first of the eight records: a
    /// charge's one atomic read-modify-write of its record, which x86 orders after every load
    /// before it and before every load after it (the next run's too), so nothing of the next
    /// packet overlaps this one's misses.
    ChargedCandidates(BorrowedFd<'a>, u32),
    /// As `Record`, in a [`PagedStore`] (its outer map, its pages).
    PagedRecord(BorrowedFd<'a>, u32),
    /// As `Candidates`, in a [`PagedStore`] (its outer map, its pages).
    PagedCandidates(BorrowedFd<'a>, u32),
    /// The 8 records of two random sets of one random group of 8 sets ([`TAG_LINE_RECORDS`]
    /// records) in a [`LayoutStore`] (its array of 8-byte words, its groups, a record's words):
    /// words 0 and 2 of each (bytes 0..8 and 16..24), the lines a key's compare reads, two where
    /// a record of 56 bytes crosses a line.
    Layout(BorrowedFd<'a>, u32, u32),
}

/// An array of 8-byte words standing for a bucket store of `groups` groups of
/// [`TAG_LINE_RECORDS`] records of `words` words each, packed, no page boundary kept: what the
/// key's 8 records would cost to read with records of 56 bytes (7 words) against 64 (8), read by
/// [`Touch::Layout`] (`--layout-floors`). Zeroed, only read.
pub struct LayoutStore {
    pub words: OwnedFd,
    pub groups: u32,
    pub record_words: u32,
}

impl LayoutStore {
    /// A store of at least `records` records of `record_words` words.
    pub fn new(records: u32, record_words: u32) -> Result<Self> {
        let groups = records.div_ceil(TAG_LINE_RECORDS);
        let entries = groups
            .checked_mul(TAG_LINE_RECORDS * record_words)
            .context("a layout store of more than 2^32 words")?;
        let words = create_map(MAP_ARRAY, 4, 8, entries, 0)?;
        Ok(Self {
            words,
            groups,
            record_words,
        })
    }

    /// Its touch.
    pub fn touch(&self) -> Touch<'_> {
        Touch::Layout(self.words.as_fd(), self.groups, self.record_words)
    }
}

/// Records of a group of the bucket store: those whose tags share a line.
const TAG_LINE_RECORDS: u32 = ratelimit_common::TAG_LINE_RECORDS;

/// Pages (of 64 records) per inner map of a [`PagedStore`]: 7 x 4 KiB plus the array's header
/// is the most that stays at or under 32 KiB, which the kernel allocates with `kmalloc` (memory
/// of its direct map, mapped with huge pages) where a larger array is `vmalloc`ed (4 KiB pages).
pub const PAGED_PAGES_PER_MAP: u32 = 7;

/// A store of 64-byte records laid out as the bucket store's pages, but held in many small array
/// maps under an array of maps, so that its memory is `kmalloc`ed (see [`PAGED_PAGES_PER_MAP`]).
/// Only read, by the drivers' touches (`--paged-floors`): what a store on huge pages would cost
/// to read. (Its records start 312 bytes into each map, not on a cache line: the touches read
/// one word of each, one line; a real store there would cross lines.)
pub struct PagedStore {
    pub outer: OwnedFd,
    pub pages: u32,
}

/// Records of a page of the bucket store (16 sets of 4).
const PAGE_RECORDS: u32 = ratelimit_common::BUCKET_WAYS * ratelimit_common::BUCKET_SETS_PER_PAGE;

/// `BPF_MAP_TYPE_ARRAY_OF_MAPS`.
const MAP_ARRAY_OF_MAPS: u32 = 12;

impl PagedStore {
    /// A store of at least `records` records, zeroed.
    pub fn new(records: u32) -> Result<Self> {
        Self::filled(records, None)
    }

    /// A store of at least `records` records, every byte `fill` (if any; through the syscall,
    /// record by record: for small stores).
    pub fn filled(records: u32, fill: Option<u8>) -> Result<Self> {
        let pages = records.div_ceil(PAGE_RECORDS);
        let maps = pages.div_ceil(PAGED_PAGES_PER_MAP);
        let inner_records = PAGED_PAGES_PER_MAP * PAGE_RECORDS;
        let template = create_map(MAP_ARRAY, 4, 64, inner_records, 0)?;
        let outer = create_map_of(MAP_ARRAY_OF_MAPS, 4, 4, maps, 0, Some(template.as_fd()))?;
        for i in 0..maps {
            let inner = create_map(MAP_ARRAY, 4, 64, inner_records, 0)?;
            if let Some(byte) = fill {
                for r in 0..inner_records {
                    update_elem(inner.as_fd(), r, &[byte; 64]).context("filling a page map")?;
                }
            }
            let value = u32::try_from(inner.as_raw_fd()).expect("fd");
            update_elem(outer.as_fd(), i, &value).context("adding a page map")?;
        }
        Ok(Self { outer, pages })
    }
}

/// `r9 += ` the word at byte 16 of entry `base + add` of the inner map spilled at r10-16 (see
/// [`paged_page`]), where `base` names a callee-saved register.
fn paged_entry(base: u8, add: i32) -> Vec<Insn> {
    record_word(&[insn(LDX_DW, 1, 10, -16, 0)], base, add)
}

/// A random page of the paged store (`outer`, `pages`): its inner map spilled at r10-16, r7 =
/// its first record in that map, r8 = a random number.
fn paged_page(outer: BorrowedFd<'_>, pages: u32) -> Vec<Insn> {
    let per = i32::try_from(PAGED_PAGES_PER_MAP).expect("7");
    let maps = i32::try_from(pages.div_ceil(PAGED_PAGES_PER_MAP)).expect("n < 2^31");
    // One modulo, as the plain store's touch has: the map; the page in it by a multiply-shift
    // of other random bits.
    let mut p = vec![
        insn(CALL, 0, 0, 0, FUNC_GET_PRANDOM_U32),
        insn(MOV64_REG, 8, 0, 0, 0), // r8 = random
        insn(MOD64_IMM, 0, 0, 0, maps),
        insn(STX_W, 10, 0, -4, 0), // key = random % maps
    ];
    p.extend(entry_at_fp4(outer));
    p.extend([
        insn(STX_DW, 10, 0, -16, 0), // the inner map, spilled
        insn(MOV64_REG, 7, 8, 0, 0), // r7 = ((random >> 24) * 7) >> 8: a page of the map
        insn(RSH64_IMM, 7, 0, 0, 24),
        insn(MUL64_IMM, 7, 0, 0, per),
        insn(RSH64_IMM, 7, 0, 0, 8),
        insn(
            LSH64_IMM,
            7,
            0,
            0,
            PAGE_RECORDS.trailing_zeros().cast_signed(),
        ),
    ]);
    p
}

/// `r9 += ` the word at byte 16 of entry `base + add` of `map`, where `base` names a
/// callee-saved register (r6-r9), which the lookup's call leaves as it was.
fn add_record_word(map: BorrowedFd<'_>, base: u8, add: i32) -> Vec<Insn> {
    record_word(&ld_map_fd(1, map), base, add)
}

/// `r9 += ` the word at byte 16 of entry `base + add` of the map that `load_map` puts in r1
/// (see [`LOOKUP_AT_FP4`]).
fn record_word(load_map: &[Insn], base: u8, add: i32) -> Vec<Insn> {
    let mut p = vec![
        insn(MOV64_REG, 1, base, 0, 0),
        insn(ADD64_IMM, 1, 0, 0, add),
        insn(STX_W, 10, 1, -4, 0),
    ];
    p.extend_from_slice(load_map);
    p.extend(LOOKUP_AT_FP4);
    p.extend([insn(LDX_DW, 1, 0, 16, 0), insn(ADD64_REG, 9, 1, 0, 0)]);
    p
}

/// With r8 = a random number: r1 = a random set of a group of 8, `(random >> 8) & 7`, and r8 =
/// one of the 7 others, `(r1 + 1 + ((random >> 12) & 0xffff) * 7 >> 16) & 7` (as
/// `ratelimit_common::bucket_sets` picks a key's two sets in a group).
const TWO_SETS: [Insn; 10] = [
    insn(MOV64_REG, 1, 8, 0, 0),
    insn(RSH64_IMM, 1, 0, 0, 8),
    insn(AND64_IMM, 1, 0, 0, 7),
    insn(RSH64_IMM, 8, 0, 0, 12),
    insn(AND64_IMM, 8, 0, 0, 0xffff),
    insn(MUL64_IMM, 8, 0, 0, 7),
    insn(RSH64_IMM, 8, 0, 0, 16),
    insn(ADD64_IMM, 8, 0, 0, 1),
    insn(ADD64_REG, 8, 1, 0, 0),
    insn(AND64_IMM, 8, 0, 0, 7),
];

/// With r7 = the first record of a page and r8 = a random number: `read(base, way)` of each of
/// the 8 records of two random, different sets of one random group of 8 sets of the page (as
/// `ratelimit_common::bucket_sets` places a key's two sets: a group is the records whose tags
/// share a line), with `base` the register holding a set's first record (r7, r8).
fn candidates(read: impl Fn(u8, i32) -> Vec<Insn>) -> Vec<Insn> {
    const _: () = assert!(
        ratelimit_common::TAG_LINE_SETS == 8 && ratelimit_common::BUCKET_SETS_PER_PAGE == 16
    );
    let mut p = vec![
        insn(MOV64_REG, 2, 8, 0, 0), // the group's first set: ((random >> 11) & 1) x 8
        insn(RSH64_IMM, 2, 0, 0, 11),
        insn(AND64_IMM, 2, 0, 0, 1),
        insn(LSH64_IMM, 2, 0, 0, 3),
    ];
    p.extend(TWO_SETS);
    p.extend([
        insn(ADD64_REG, 1, 2, 0, 0),
        insn(ADD64_REG, 8, 2, 0, 0),
        insn(LSH64_IMM, 1, 0, 0, 2),
        insn(LSH64_IMM, 8, 0, 0, 2),
        insn(ADD64_REG, 8, 7, 0, 0), // r8 = the second set's first record
        insn(ADD64_REG, 7, 1, 0, 0), // r7 = the first set's first record
    ]);
    let ways = i32::try_from(ratelimit_common::BUCKET_WAYS).expect("4");
    for base in [7, 8] {
        for way in 0..ways {
            p.extend(read(base, way));
        }
    }
    p
}

/// `r9 += ` entry `base + add` (an 8-byte word) of `map`, where `base` names a callee-saved
/// register.
fn add_word(map: BorrowedFd<'_>, base: u8, add: i32) -> Vec<Insn> {
    let mut p = vec![
        insn(MOV64_REG, 1, base, 0, 0),
        insn(ADD64_IMM, 1, 0, 0, add),
        insn(STX_W, 10, 1, -4, 0),
    ];
    p.extend(entry_at_fp4(map));
    p.extend([insn(LDX_DW, 1, 0, 0, 0), insn(ADD64_REG, 9, 1, 0, 0)]);
    p
}

/// [`Touch::Layout`]: a random group, two different random sets of it (as `candidates`
/// picks them), words 0 and 2 of each of their 8 records.
fn layout_candidates(map: BorrowedFd<'_>, groups: u32, words: u32) -> Vec<Insn> {
    let group = i32::try_from(TAG_LINE_RECORDS * words).expect("a group's words");
    let set = i32::try_from(ratelimit_common::BUCKET_WAYS * words).expect("a set's words");
    let mut p = vec![
        insn(CALL, 0, 0, 0, FUNC_GET_PRANDOM_U32),
        insn(MOV64_REG, 8, 0, 0, 0), // r8 = random
        insn(
            MOD64_IMM,
            0,
            0,
            0,
            i32::try_from(groups).expect("groups < 2^31"),
        ),
        insn(MUL64_IMM, 0, 0, 0, group),
        insn(MOV64_REG, 7, 0, 0, 0), // r7 = the group's first word
    ];
    p.extend(TWO_SETS);
    p.extend([
        insn(MUL64_IMM, 1, 0, 0, set),
        insn(MUL64_IMM, 8, 0, 0, set),
        insn(ADD64_REG, 8, 7, 0, 0), // r8 = the second set's first word
        insn(ADD64_REG, 7, 1, 0, 0), // r7 = the first set's first word
    ]);
    let (ways, words) = (
        i32::try_from(ratelimit_common::BUCKET_WAYS).expect("4"),
        i32::try_from(words).expect("a record's words"),
    );
    for base in [7, 8] {
        for way in 0..ways {
            for word in [0, 2] {
                p.extend(add_word(map, base, way * words + word));
            }
        }
    }
    p
}

/// The instructions of `touch`: the words read summed into r9 (zero before, see [`driver`]),
/// then r9 masked to zero (so what depends on r9 waits for every read).
fn touch_store(touch: Touch<'_>) -> Vec<Insn> {
    let mut p = Vec::new();
    match touch {
        Touch::Record(map, n) => {
            p.extend(random_entry(map, n));
            p.push(insn(LDX_DW, 9, 0, 16, 0));
        }
        Touch::PagedRecord(outer, pages) => {
            p.extend(paged_page(outer, pages));
            p.extend([
                insn(RSH64_IMM, 8, 0, 0, 8),
                insn(AND64_IMM, 8, 0, 0, 63),
                insn(ADD64_REG, 7, 8, 0, 0),
            ]);
            p.extend(paged_entry(7, 0));
        }
        Touch::PagedCandidates(outer, pages) => {
            p.extend(paged_page(outer, pages));
            p.extend(candidates(paged_entry));
        }
        Touch::Layout(map, groups, words) => p.extend(layout_candidates(map, groups, words)),
        Touch::Candidates(map, n) | Touch::ChargedCandidates(map, n) => {
            let pages = i32::try_from(n / PAGE_RECORDS).expect("n < 2^31");
            p.extend([
                insn(CALL, 0, 0, 0, FUNC_GET_PRANDOM_U32),
                insn(MOV64_REG, 8, 0, 0, 0), // r8 = random
                insn(MOD64_IMM, 0, 0, 0, pages),
                insn(
                    LSH64_IMM,
                    0,
                    0,
                    0,
                    PAGE_RECORDS.trailing_zeros().cast_signed(),
                ),
                insn(MOV64_REG, 7, 0, 0, 0), // r7 = the page's first record
            ]);
            p.extend(candidates(|base, way| add_record_word(map, base, way)));
            if let Touch::ChargedCandidates(..) = touch {
                // The first set's first record again (r7, kept across the lookups), in cache
                // now: `lock add [record + 16], 0` (the header word, left as it was).
                p.extend([insn(MOV64_REG, 1, 7, 0, 0), insn(STX_W, 10, 1, -4, 0)]);
                p.extend(entry_at_fp4(map));
                p.extend([insn(MOV64_IMM, 1, 0, 0, 0), insn(ATOMIC_DW, 0, 1, 16, 0)]);
            }
        }
    }
    p.push(insn(AND64_IMM, 9, 0, 0, 0));
    p
}

/// A driver: rewrites the IPv4 source as `sources` says, then tail-calls slot 0 of `prog_array`.
/// Returns `XDP_ABORTED` if the tail call fails (so a failed call cannot pass for the target's
/// `XDP_PASS`).
///
/// With a [`Touch`], it first reads records of the bucket store (the word at byte 16 of each),
/// and makes the frame's new source depend on what it read.
pub fn driver(
    sources: Sources<'_>,
    touch: Option<Touch<'_>>,
    prog_array: BorrowedFd<'_>,
) -> Vec<Insn> {
    let mut p = vec![insn(MOV64_REG, 6, 1, 0, 0), insn(MOV64_IMM, 9, 0, 0, 0)];
    if let Some(touch) = touch {
        p.extend(touch_store(touch));
    }
    let body: Vec<Insn> = match sources {
        Sources::Sequential => {
            let mut body = NEXT_SOURCE.to_vec();
            // The next address plus r9 (zero): with a touch, its store waits for the record.
            body.insert(3, insn(ADD64_REG, 5, 9, 0, 0));
            body
        }
        Sources::InTurn(map, n) | Sources::InTurnWarm(map, n, _) => {
            let n = i32::try_from(n).expect("n < 2^31");
            p.extend([insn(MOV64_IMM, 0, 0, 0, n), insn(STX_W, 10, 0, -4, 0)]);
            p.extend(entry_at_fp4(map)); // r0 = the cursor, entry n
            p.extend([
                insn(MOV64_REG, 8, 0, 0, 0), // r8 = &cursor
                insn(LDX_W, 1, 8, 0, 0),     // r1 = cursor
                insn(MOV64_REG, 0, 1, 0, 0),
                insn(ADD64_IMM, 0, 0, 0, 1),
                insn(MOD64_IMM, 0, 0, 0, n),
                insn(STX_W, 8, 0, 0, 0),   // cursor = (cursor + 1) % n
                insn(STX_W, 10, 1, -4, 0), // key = the old cursor
            ]);
            p.extend(entry_at_fp4(map));
            p.push(insn(LDX_W, 7, 0, 0, 0)); // r7 = the address
            if let Sources::InTurnWarm(_, _, store) = sources {
                p.extend([
                    insn(LDX_W, 8, 0, 4, 0), // r8 = the first set's first record
                    insn(LDX_W, 1, 0, 8, 0),
                    insn(STX_W, 10, 1, -8, 0), // the second set's, kept below the lookup key
                ]);
                let ways = i32::try_from(ratelimit_common::BUCKET_WAYS).expect("4");
                for way in 0..ways {
                    p.extend(add_record_word(store, 8, way));
                }
                p.push(insn(LDX_W, 8, 10, -8, 0));
                for way in 0..ways {
                    p.extend(add_record_word(store, 8, way));
                }
                p.push(insn(AND64_IMM, 9, 0, 0, 0));
            }
            p.push(insn(ADD64_REG, 7, 9, 0, 0)); // plus r9 (zero), as above
            vec![insn(STX_W, 2, 7, IP_SRC, 0)]
        }
    };
    p.extend(bounds(i16::try_from(body.len()).expect("short")));
    p.extend(body);
    p.push(insn(MOV64_REG, 1, 6, 0, 0));
    p.extend(ld_map_fd(2, prog_array));
    p.extend([
        insn(MOV64_IMM, 3, 0, 0, 0),
        insn(CALL, 0, 0, 0, FUNC_TAIL_CALL),
        insn(MOV64_IMM, 0, 0, 0, XDP_ABORTED),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    p
}

/// What a probe does before passing the frame.
#[derive(Clone, Copy, Debug)]
pub enum Probe<'a> {
    /// `bpf_ktime_get_ns()`.
    Clock,
    /// `bpf_ktime_get_coarse_ns()`.
    CoarseClock,
    /// `bpf_jiffies64()`.
    Jiffies,
    /// `bpf_map_lookup_elem(map, key)`; the lookup must hit (else the probe returns XDP_ABORTED).
    Lookup(BorrowedFd<'a>, &'a [u8]),
}

/// A probe program: does `probe` once, then returns XDP_PASS.
pub fn probe(probe: Probe<'_>) -> Vec<Insn> {
    let mut p = Vec::new();
    match probe {
        Probe::Clock => p.push(insn(CALL, 0, 0, 0, FUNC_KTIME_GET_NS)),
        Probe::CoarseClock => p.push(insn(CALL, 0, 0, 0, FUNC_KTIME_GET_COARSE_NS)),
        Probe::Jiffies => p.push(insn(CALL, 0, 0, 0, FUNC_JIFFIES64)),
        Probe::Lookup(..) => {}
    }
    p.extend([insn(MOV64_IMM, 0, 0, 0, XDP_PASS), insn(EXIT, 0, 0, 0, 0)]);
    if let Probe::Lookup(map, key) = probe {
        // Built in front of the two instructions above; a miss skips them.
        let mut pre = Vec::new();
        // The key on the stack, below r10, in 1-byte stores (keys are a few dozen bytes).
        let len = i16::try_from(key.len().next_multiple_of(8)).expect("short key");
        for (i, &b) in key.iter().enumerate() {
            let off = -len + i16::try_from(i).expect("short key");
            pre.push(insn(ST_B, 10, 0, off, i32::from(b)));
        }
        pre.extend(ld_map_fd(1, map));
        pre.extend([
            insn(MOV64_REG, 2, 10, 0, 0),
            insn(ADD64_IMM, 2, 0, 0, -i32::from(len)),
            insn(CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM),
            insn(JEQ_IMM, 0, 0, 2, 0), // miss: abort
        ]);
        pre.append(&mut p);
        p = pre;
        p.extend([
            insn(MOV64_IMM, 0, 0, 0, XDP_ABORTED),
            insn(EXIT, 0, 0, 0, 0),
        ]);
    }
    p
}

/// A test's own pin directory under `/sys/fs/bpf` (`<name>-<pid>`, so tests run in parallel),
/// removed however the test ends.
#[cfg(test)]
pub(crate) struct TestPinDir(pub std::path::PathBuf);

#[cfg(test)]
impl TestPinDir {
    pub(crate) fn new(name: &str) -> Self {
        let dir = Path::new("/sys/fs/bpf").join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

#[cfg(test)]
impl Drop for TestPinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `prog`'s verdict on `frame`, run `repeat` times through `BPF_PROG_TEST_RUN` (the last run's).
#[cfg(test)]
pub(crate) fn verdict(prog: &Xdp, frame: &[u8], repeat: u32) -> u32 {
    use aya::programs::{TestRun as _, TestRunOptions};
    prog.test_run(TestRunOptions {
        data_in: Some(frame),
        repeat,
        ..TestRunOptions::new()
    })
    .unwrap()
    .return_value
}

#[cfg(test)]
mod tests;
