//! F1, the dependent-read memory floor: what one read of a line of the bucket store costs when
//! nothing can overlap it, measured through BPF_PROG_TEST_RUN as ns per run over its floor.
//!
//! The other memory floors (`progs::Touch`) read a random record whose address does not depend
//! on the previous run's read, so the CPU starts a run's load before the previous run's miss has
//! come back: their misses overlap, and they understate one read. F1 is a pointer chase instead:
//! an array map `chain` of a region the size of the bucket store at the default `max_buckets`
//! (64-byte values, 4 KiB pages), where value `i` begins with the index of the next value of one
//! random cyclic permutation, and a one-value map `cursor` holding where the walk is. Each run
//! reads `cursor`, reads `chain[cursor]` and stores what it read back into `cursor`: its address
//! comes from the line the previous run read, so every run waits out a whole miss (and the page
//! walk of a TLB miss, as the store's lookups do), and one cycle through all the lines leaves no
//! line cached from the last time round. Its floor is the same program without the chain read
//! (`cursor` read and written back), run in turns with it. Beside it, the independent read the
//! population figures use (`rlb_seq_mem` over `rlb_seq_pass`), on the same region.

use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};

use anyhow::{bail, Context as _, Result};
use aya::programs::Xdp;
use ratelimit_common::{bucket_capacity, DEFAULT_MAX_BUCKETS};
use serde_json::json;

use crate::{
    kernel::{repeat_ns, sequential_from, Driver, TRUNCATION},
    permutation::cyclic_permutation,
    progs::{
        self, insn, Insn, Sources, Touch, EXIT, F_MMAPABLE, LDX_W, MAP_ARRAY, MOV64_IMM, MOV64_REG,
        STX_W, XDP_PASS,
    },
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

const SECTION: &str =
    "Memory floors: one dependent read (F1) vs one independent read (BPF_PROG_TEST_RUN)";

/// Bytes per value of the chain: one record of the bucket store.
const RECORD_BYTES: u32 = 64;

/// Seed of the chain's permutation: the same chain on every run.
const SEED: u64 = 0x5eed_f100_0000_0001;

/// The chase (with `chain`) or its floor (without): reads `cursor[0]`, with `chain` replaces it
/// by the first u32 of `chain[cursor[0]]`, writes it back to `cursor[0]`, and passes.
fn chase(cursor: BorrowedFd<'_>, chain: Option<BorrowedFd<'_>>) -> Vec<Insn> {
    let mut p = vec![insn(MOV64_IMM, 0, 0, 0, 0), insn(STX_W, 10, 0, -4, 0)];
    p.extend(progs::entry_at_fp4(cursor));
    p.extend([
        insn(MOV64_REG, 6, 0, 0, 0), // r6 = &cursor[0]
        insn(LDX_W, 7, 6, 0, 0),     // r7 = the index
    ]);
    if let Some(chain) = chain {
        p.push(insn(STX_W, 10, 7, -4, 0));
        p.extend(progs::entry_at_fp4(chain));
        p.push(insn(LDX_W, 7, 0, 0, 0)); // r7 = the next index, read from the line
    }
    p.extend([
        insn(STX_W, 6, 7, 0, 0),
        insn(MOV64_IMM, 0, 0, 0, XDP_PASS),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    p
}

/// The index in `cursor` (a memory-mappable one-value array).
fn cursor_of(cursor: &OwnedFd) -> Result<u32> {
    let bytes = progs::read_mapped(cursor, 4)?;
    Ok(u32::from_ne_bytes(bytes[..4].try_into().expect("4 bytes")))
}

/// Measures F1 and its floor in turns, and the independent read beside them.
pub fn run(report: &mut Report, opts: &Options, refs: &Refs) -> Result<()> {
    let n = bucket_capacity(DEFAULT_MAX_BUCKETS);
    let mib = f64::from(n) * f64::from(RECORD_BYTES) / f64::from(1u32 << 20);
    crate::session::announce(&format!(
        "memory floors: a pointer chase through {n} lines of {RECORD_BYTES} B ({mib} MiB) vs \
         independent reads"
    ));
    let next = cyclic_permutation(n, SEED);
    let chain = chain_map(&next)?;
    let cursor = progs::create_map(MAP_ARRAY, 4, 4, 1, F_MMAPABLE)?;
    let chase_prog = progs::load(
        "rlb_f1_chase",
        &chase(cursor.as_fd(), Some(chain.as_fd())),
        refs.dir(),
    )?;
    let floor_prog = progs::load("rlb_f1_floor", &chase(cursor.as_fd(), None), refs.dir())?;
    // The independent read, built as the population figures' `rlb_seq_mem` and `rlb_seq_pass`
    // are, on the chain (byte 16 of a random line).
    let pass_driver = |name: &str, touch: Option<Touch<'_>>| {
        Driver::touching(name, Sources::Sequential, touch, refs.program(PASS), refs)
    };
    let ind_floor = pass_driver("rlb_f1_seq_pass", None)?;
    let ind_read = pass_driver("rlb_f1_seq_mem", Some(Touch::Record(chain.as_fd(), n)))?;
    let frame = crate::kernel::v4_frame([198, 18, 0, 1]);
    let driver_frame = sequential_from([10, 128, 0, 0]);

    repeat_ns(&chase_prog, &frame, 1000)?;
    repeat_ns(&floor_prog, &frame, 1000)?;
    let mut runs = Runs::default();
    for run in 0..opts.runs {
        crate::session::check_interrupted()?;
        // Which of the chase and its floor goes first alternates from run to run.
        for first in [run % 2 == 0, run % 2 != 0] {
            if first {
                runs.chase.push(chase_once(
                    &chase_prog,
                    &cursor,
                    &next,
                    &frame,
                    opts.repeat,
                )?);
            } else {
                let (k, _, action) = repeat_ns(&floor_prog, &frame, opts.repeat)?;
                if action != XDP_PASS.cast_unsigned() {
                    bail!("the chase's floor returned action {action}, not XDP_PASS");
                }
                runs.floor.push(k + TRUNCATION);
            }
        }
        runs.ind_floor
            .push(ind_floor.run(&driver_frame, opts.repeat)?);
        runs.ind.push(ind_read.run(&driver_frame, opts.repeat)?);
    }
    let detail = json!({
        "repeat": opts.repeat,
        "lines": n,
        "line_bytes": RECORD_BYTES,
        "region_bytes": u64::from(n) * u64::from(RECORD_BYTES),
        "seed": SEED,
    });
    runs.report(report, &format!("{mib} MiB, 4 KiB pages"), &detail);
    Ok(())
}

/// The chain: an array of `next.len()` lines of [`RECORD_BYTES`], line `i` beginning with
/// `next[i]`.
fn chain_map(next: &[u32]) -> Result<OwnedFd> {
    let n = u32::try_from(next.len()).context("a chain of more than 2^32 lines")?;
    let chain = progs::create_map(MAP_ARRAY, 4, RECORD_BYTES, n, F_MMAPABLE)?;
    let mut bytes = vec![0u8; next.len() * RECORD_BYTES as usize];
    for (line, &to) in bytes.chunks_exact_mut(RECORD_BYTES as usize).zip(next) {
        line[..4].copy_from_slice(&to.to_ne_bytes());
    }
    progs::write_mapped(&chain, &bytes).context("writing the chain")?;
    Ok(chain)
}

/// One run of the chase, `repeat` steps: ns a step, checked to have walked the chain (the
/// cursor is where `repeat` steps of `next` from where it was lead).
fn chase_once(
    prog: &Xdp,
    cursor: &OwnedFd,
    next: &[u32],
    frame: &[u8],
    repeat: u32,
) -> Result<f64> {
    let at = cursor_of(cursor)?;
    let (k, _, action) = repeat_ns(prog, frame, repeat)?;
    if action != XDP_PASS.cast_unsigned() {
        bail!("the chase returned action {action}, not XDP_PASS");
    }
    let now = cursor_of(cursor)?;
    let walked = (0..repeat).fold(at, |at, _| next[at as usize]);
    if now != walked {
        bail!("the chase left the cursor at {now}, not where {repeat} steps from {at} lead");
    }
    Ok(k + TRUNCATION)
}

/// The runs of the chase, its floor, and the independent read and its floor, ns each.
#[derive(Default)]
struct Runs {
    chase: Vec<f64>,
    floor: Vec<f64>,
    ind: Vec<f64>,
    ind_floor: Vec<f64>,
}

impl Runs {
    /// The figures, F1 and the independent read each over its floor, paired by run.
    fn report(self, report: &mut Report, region: &str, detail: &serde_json::Value) {
        let diff =
            |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a - b).collect() };
        let f1 = diff(&self.chase, &self.floor);
        let independent = diff(&self.ind, &self.ind_floor);
        eprintln!(
            "    F1, one dependent read: {:.1} ns over its floor; one independent read: {:.1} ns \
             over its floor",
            crate::report::median(&f1),
            crate::report::median(&independent)
        );
        let figures = [
            (
                "kernel.f1.floor",
                "floor: F1 without the chain (cursor read, written back)".to_owned(),
                self.floor,
                None,
            ),
            (
                "kernel.f1.chase",
                format!("F1 chase: cursor -> chain[cursor], {region}"),
                self.chase,
                Some("kernel.f1.floor"),
            ),
            (
                "kernel.f1",
                "F1: one dependent read, chase - floor (paired by run)".to_owned(),
                f1,
                None,
            ),
            (
                "kernel.f1.independent_floor",
                "floor: new-source driver + XDP_PASS (rlb_seq_pass)".to_owned(),
                self.ind_floor,
                None,
            ),
            (
                "kernel.f1.independent_read",
                format!("rlb_seq_mem: a random line, then XDP_PASS, {region}"),
                self.ind,
                Some("kernel.f1.independent_floor"),
            ),
            (
                "kernel.f1.independent",
                "one independent read, rlb_seq_mem - floor (paired by run)".to_owned(),
                independent,
                None,
            ),
        ];
        for (key, label, runs, baseline) in figures {
            report.add(Figure {
                key: key.into(),
                section: SECTION,
                label,
                unit: "ns/pkt",
                runs,
                baseline: baseline.map(Into::into),
                detail: detail.clone(),
            });
        }
    }
}
