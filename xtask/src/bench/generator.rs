//! Traffic for the end-to-end runs: an XDP program run by BPF_PROG_TEST_RUN in live-frames mode
//! (BPF_F_TEST_XDP_LIVE_FRAMES) with `ingress_ifindex` set to the sending veth; each XDP_TX sends
//! the frame to the veth's peer, where the program or firewall under test receives it.
//!
//! Two generators: `bench_tx` from the project's object sends one frame again and again (one hot
//! source); [`RandomSource`] rewrites the source address of every frame with a random one first
//! (a spoofed flood). The kernel fills the live-frames page pool with the input frame once and
//! recycles its pages without copying the frame again, so a program that rewrites a field finds
//! its own last write there; the random generator writes the whole field every time.

use std::{
    ffi::CString,
    fs,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use aya::programs::{TestRun as _, TestRunAttrs, TestRunOptions, Xdp};
use ratelimit_testbed::{in_netns, Netns};

/// Frames per live-frames batch: the kernel's default (64). After each batch the test run flushes
/// the frames to the peer veth and re-enables bottom halves, so the receiving NAPI poll runs on
/// the same CPU between batches; a batch well under the veth ring (256) loses no frames there.
pub const BATCH: u32 = 64;
/// Frames per BPF_PROG_TEST_RUN call; a call takes some tens of milliseconds.
const FRAMES_PER_CALL: u32 = 1 << 16;
/// Wire length of the generated frames (without FCS): the Ethernet minimum.
pub const FRAME_LEN: usize = 60;

/// The first octet of the random generator's sources: it rewrites the other three (24 bits), so
/// sources repeat rarely within a bucket map of a million. Not the RFC 2544 benchmarking range
/// (198.18.0.0/15 has 17 bits); these frames never leave the bench's own namespaces.
pub const RANDOM_NET: u8 = 10;

/// One IPv4/UDP frame from `src` to `dst`, Ethernet addresses `src_mac` -> `dst_mac`, padded to
/// [`FRAME_LEN`], with a correct IPv4 header checksum (the receiving stack checks it; the UDP
/// checksum is left zero, "none", which IPv4 allows).
pub fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: std::net::Ipv4Addr,
    dst: std::net::Ipv4Addr,
) -> Vec<u8> {
    let mut f = ratelimit_testbed::packet::eth()
        .ipv4(src, dst)
        .udp(40_000, 9)
        .pad_to(FRAME_LEN)
        .build();
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    set_ipv4_checksum(&mut f[14..34]);
    f
}

/// Writes the checksum of a 20-byte IPv4 header into it.
pub fn set_ipv4_checksum(h: &mut [u8]) {
    h[10] = 0;
    h[11] = 0;
    let mut sum: u32 = h.chunks_exact(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    #[expect(clippy::cast_possible_truncation, reason = "folded to 16 bits above")]
    let csum = !(sum as u16);
    h[10..12].copy_from_slice(&csum.to_be_bytes());
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let bytes: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad MAC address {s:?}"))?;
    bytes.try_into().map_err(|_| anyhow::anyhow!("bad MAC address {s:?}"))
}

/// The random-source generator: XDP bytecode that stores 24 random bits in the last three bytes
/// of the IPv4 source address and keeps the header checksum valid by writing the one's complement
/// of their sum into the IP ID field, then returns XDP_TX.
///
/// Hand-assembled rather than part of the project's XDP object, which this benchmark does not
/// change (see BENCHMARKS.md for the `bench_tx_random` program proposed there). It expects the
/// frame of [`udp_frame`] with source `RANDOM_NET.0.0.0` and IP ID 0: replacing bytes b1, (b2 b3)
/// of the address adds `s = b1 + b2b3` to the header's one's-complement sum, and an ID of `!s`
/// adds 0xffff, which is zero in one's complement, so the original checksum stays right.
pub struct RandomSource {
    program: Xdp,
}

// BPF instruction encoding (include/uapi/linux/bpf.h).
const MOV64_REG: u8 = 0xbf;
const MOV64_IMM: u8 = 0xb7;
const ADD64_IMM: u8 = 0x07;
const ADD64_REG: u8 = 0x0f;
const AND64_IMM: u8 = 0x57;
const RSH64_IMM: u8 = 0x77;
const XOR64_IMM: u8 = 0xa7;
const LDX_W: u8 = 0x61;
const STX_B: u8 = 0x73;
const JGT_REG: u8 = 0x2d;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const BPF_FUNC_GET_PRANDOM_U32: i32 = 7;
const XDP_TX: i32 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;

#[derive(Clone, Copy)]
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: dst | (src << 4), off, imm }
}

/// Offsets in the frame (Ethernet header 14 bytes, then IPv4).
const IP_ID: i16 = 14 + 4;
const IP_SRC: i16 = 14 + 12;

fn random_source_insns() -> Vec<Insn> {
    vec![
        insn(MOV64_REG, 6, 1, 0, 0),                        // r6 = ctx
        insn(CALL, 0, 0, 0, BPF_FUNC_GET_PRANDOM_U32),      // r0 = random
        insn(MOV64_REG, 7, 0, 0, 0),                        // r7 = random
        insn(LDX_W, 2, 6, 0, 0),                            // r2 = ctx->data
        insn(LDX_W, 3, 6, 4, 0),                            // r3 = ctx->data_end
        insn(MOV64_REG, 4, 2, 0, 0),                        // r4 = data
        insn(ADD64_IMM, 4, 0, 0, 34),                       // r4 = data + 34 (eth + ipv4)
        insn(JGT_REG, 4, 3, 20, 0),                         // too short: skip to the exit
        insn(MOV64_REG, 5, 7, 0, 0),                        // r5 = b1 = random & 0xff
        insn(AND64_IMM, 5, 0, 0, 0xff),
        insn(STX_B, 2, 5, IP_SRC + 1, 0),                   // src[1] = b1
        insn(MOV64_REG, 8, 7, 0, 0),                        // r8 = b2b3 = (random >> 8) & 0xffff
        insn(RSH64_IMM, 8, 0, 0, 8),
        insn(AND64_IMM, 8, 0, 0, 0xffff),
        insn(MOV64_REG, 9, 8, 0, 0),                        // src[2] = b2b3 >> 8
        insn(RSH64_IMM, 9, 0, 0, 8),
        insn(STX_B, 2, 9, IP_SRC + 2, 0),
        insn(STX_B, 2, 8, IP_SRC + 3, 0),                   // src[3] = b2b3 & 0xff
        insn(ADD64_REG, 5, 8, 0, 0),                        // s = b1 + b2b3, folded to 16 bits
        insn(MOV64_REG, 9, 5, 0, 0),
        insn(RSH64_IMM, 9, 0, 0, 16),
        insn(AND64_IMM, 5, 0, 0, 0xffff),
        insn(ADD64_REG, 5, 9, 0, 0),
        insn(XOR64_IMM, 5, 0, 0, 0xffff),                   // id = !s
        insn(MOV64_REG, 9, 5, 0, 0),
        insn(RSH64_IMM, 9, 0, 0, 8),
        insn(STX_B, 2, 9, IP_ID, 0),                        // id, big-endian
        insn(STX_B, 2, 5, IP_ID + 1, 0),
        insn(MOV64_IMM, 0, 0, 0, XDP_TX),
        insn(EXIT, 0, 0, 0, 0),
    ]
}

impl RandomSource {
    /// Loads the program. It is pinned in `pin_dir` (bpffs) just long enough for aya to open it.
    pub fn load(pin_dir: &Path) -> Result<Self> {
        let insns = random_source_insns();
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
        let mut name = [0u8; 16];
        name[..11].copy_from_slice(b"bench_txrnd");
        let attr = ProgLoad {
            prog_type: BPF_PROG_TYPE_XDP,
            insn_cnt: u32::try_from(insns.len()).expect("a few instructions"),
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 1,
            log_size: u32::try_from(log.len()).expect("64 KiB"),
            log_buf: log.as_mut_ptr() as u64,
            kern_version: 0,
            prog_flags: 0,
            prog_name: name,
            prog_ifindex: 0,
            expected_attach_type: 0,
        };
        // SAFETY: `attr` is a valid prefix of union bpf_attr for BPF_PROG_LOAD; every pointer in
        // it points at memory that outlives the call.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_LOAD,
                std::ptr::from_ref(&attr),
                std::mem::size_of::<ProgLoad>(),
            )
        };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            bail!(
                "loading the random-source generator: {err}\n{}",
                String::from_utf8_lossy(&log[..end])
            );
        }
        // SAFETY: the kernel just returned this fd to us and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).expect("an fd")) };

        let pin = pin_dir.join("bench_tx_random");
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
        // SAFETY: as above, for BPF_OBJ_PIN.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_OBJ_PIN,
                std::ptr::from_ref(&attr),
                std::mem::size_of::<ObjPin>(),
            )
        };
        if rc != 0 {
            bail!("pinning the random-source generator at {}: {}", pin.display(), std::io::Error::last_os_error());
        }
        let program = Xdp::from_pin(&pin, aya_obj::programs::XdpAttachType::Interface);
        let _ = fs::remove_file(&pin);
        drop(fd);
        let program = program.context("opening the pinned random-source generator")?;
        Ok(Self { program })
    }

    /// The loaded program.
    pub fn program(&self) -> &Xdp {
        &self.program
    }
}

/// What one timed blast sent.
#[derive(Clone, Copy, Debug)]
pub struct Blast {
    /// Frames the generator ran (each transmitted to the peer, or dropped there when its ring was
    /// full).
    pub frames: u64,
    /// Wall-clock time of the blast.
    pub elapsed: Duration,
}

/// Pins the calling thread to `cpu`.
///
/// The generator and the polite sender run on one CPU, so that the receiving veth's NAPI poll,
/// which runs where it was last scheduled from, always runs there too: a packet sent from another
/// CPU would move it (and the pipeline would straddle two CPUs for a while).
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only touch
    // it and the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set) != 0 {
            bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs `program` in live-frames mode with `frame` as input, transmitting to the peer of
/// `ifindex` (an interface of `ns`), for about `duration`, on `cpu`.
pub fn blast(
    program: &Xdp,
    ns: &Netns,
    ifindex: u32,
    frame: &[u8],
    duration: Duration,
    cpu: usize,
) -> Result<Blast> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let len = u32::try_from(frame.len()).context("frame length")?;
    let md: [u32; 6] = [0, len, 0, ifindex, 0, 0];
    let ctx: Vec<u8> = md.iter().flat_map(|w| w.to_ne_bytes()).collect();
    // The test run resolves `ingress_ifindex` in the calling thread's network namespace.
    in_netns(ns, || {
        pin_to_cpu(cpu)?;
        let start = Instant::now();
        let mut frames = 0u64;
        while start.elapsed() < duration {
            let opts = TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat: FRAMES_PER_CALL,
                attrs: TestRunAttrs::new().xdp_live_frames(BATCH),
                ..TestRunOptions::new()
            };
            program.test_run(opts).context("BPF_PROG_TEST_RUN in live-frames mode")?;
            frames += u64::from(FRAMES_PER_CALL);
        }
        Ok(Blast { frames, elapsed: start.elapsed() })
    })
}
