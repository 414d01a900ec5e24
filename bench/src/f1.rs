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
// Stays whole: one measurement: the chain built, its runs in turns with its floor, the figures.
pub fn run(report: &mut Report, opts: &Options, refs: &Refs) -> Result<()> {
    let n = bucket_capacity(DEFAULT_MAX_BUCKETS);
    let mib = f64::from(n) * f64::from(RECORD_BYTES) / f64::from(1u32 << 20);
    crate::session::announce(&format!(
        "memory floors: a pointer chase through {n} lines of {RECORD_BYTES} B ({mib} MiB) vs \
         independent reads"
    ));
    let next = cyclic_permutation(n, SEED);
    let chain = progs::create_map(MAP_ARRAY, 4, RECORD_BYTES, n, F_MMAPABLE)?;
    let mut bytes = vec![0u8; next.len() * RECORD_BYTES as usize];
    for (line, &to) in bytes.chunks_exact_mut(RECORD_BYTES as usize).zip(&next) {
        line[..4].copy_from_slice(&to.to_ne_bytes());
    }
    progs::write_mapped(&chain, &bytes).context("writing the chain")?;
    drop(bytes);
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

    // Where the walk must be after `runs` more runs from `at`.
    let walk = |mut at: u32, runs: u32| {
        for _ in 0..runs {
            at = next[at as usize];
        }
        at
    };
    repeat_ns(&chase_prog, &frame, 1000)?;
    repeat_ns(&floor_prog, &frame, 1000)?;
    let (mut chase_ns, mut floor_ns, mut ind_ns, mut ind_floor_ns) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 0..opts.runs {
        crate::session::check_interrupted()?;
        // Which of the chase and its floor goes first alternates from run to run.
        for first in [run % 2 == 0, run % 2 != 0] {
            if first {
                let at = cursor_of(&cursor)?;
                let (k, _, action) = repeat_ns(&chase_prog, &frame, opts.repeat)?;
                if action != XDP_PASS.cast_unsigned() {
                    bail!("the chase returned action {action}, not XDP_PASS");
                }
                let now = cursor_of(&cursor)?;
                if now != walk(at, opts.repeat) {
                    bail!(
                        "the chase left the cursor at {now}, not where {} steps from {at} lead",
                        opts.repeat
                    );
                }
                chase_ns.push(k + TRUNCATION);
            } else {
                let (k, _, action) = repeat_ns(&floor_prog, &frame, opts.repeat)?;
                if action != XDP_PASS.cast_unsigned() {
                    bail!("the chase's floor returned action {action}, not XDP_PASS");
                }
                floor_ns.push(k + TRUNCATION);
            }
        }
        ind_floor_ns.push(ind_floor.run(&driver_frame, opts.repeat)?);
        ind_ns.push(ind_read.run(&driver_frame, opts.repeat)?);
    }
    let diff = |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a - b).collect() };
    let f1 = diff(&chase_ns, &floor_ns);
    let independent = diff(&ind_ns, &ind_floor_ns);
    let region = format!("{mib} MiB, 4 KiB pages");
    let detail = json!({
        "repeat": opts.repeat,
        "lines": n,
        "line_bytes": RECORD_BYTES,
        "region_bytes": u64::from(n) * u64::from(RECORD_BYTES),
        "seed": SEED,
    });
    let mut add = |key: &str, label: String, runs: Vec<f64>, baseline: Option<&str>| {
        report.add(Figure {
            key: key.into(),
            section: SECTION,
            label,
            unit: "ns/pkt",
            runs,
            baseline: baseline.map(Into::into),
            detail: detail.clone(),
        });
    };
    add(
        "kernel.f1.floor",
        "floor: F1 without the chain (cursor read, written back)".into(),
        floor_ns,
        None,
    );
    add(
        "kernel.f1.chase",
        format!("F1 chase: cursor -> chain[cursor], {region}"),
        chase_ns,
        Some("kernel.f1.floor"),
    );
    add(
        "kernel.f1",
        "F1: one dependent read, chase - floor (paired by run)".into(),
        f1.clone(),
        None,
    );
    add(
        "kernel.f1.independent_floor",
        "floor: new-source driver + XDP_PASS (rlb_seq_pass)".into(),
        ind_floor_ns,
        None,
    );
    add(
        "kernel.f1.independent_read",
        format!("rlb_seq_mem: a random line, then XDP_PASS, {region}"),
        ind_ns,
        Some("kernel.f1.independent_floor"),
    );
    add(
        "kernel.f1.independent",
        "one independent read, rlb_seq_mem - floor (paired by run)".into(),
        independent.clone(),
        None,
    );
    eprintln!(
        "    F1, one dependent read: {:.1} ns over its floor; one independent read: {:.1} ns over \
         its floor",
        crate::report::median(&f1),
        crate::report::median(&independent)
    );
    Ok(())
}
