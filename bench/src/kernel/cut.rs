//! The A/B of the handling of cut packets: the limiter and its bench-only build without that
//! handling ([`WithoutCut`]) on the same whole frames, alternately within each run.

use anyhow::{Context as _, Result};
use aya::programs::Xdp;
use ratelimit_common::map_names;
use serde_json::json;

use super::{action_name, repeat_ns, v4_frame, v6_frame, Limiter, TRUNCATION};
use crate::{
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

/// The bench-only build of the XDP program without the handling of cut packets (ratelimit-ebpf's
/// feature `bench-without-cut`: every packet classified as a whole one, no fragment table, no
/// destination address or fragment id parsed), loaded on the limiter's own pinned maps (same
/// rules, same buckets; its per-CPU caches are its own). `cargo xtask bench` builds it and
/// passes its path in `RATELIMIT_BENCH_WITHOUT_CUT`.
pub struct WithoutCut {
    ebpf: aya::Ebpf,
}

/// Where `cargo xtask bench` says the object of [`WithoutCut`] is.
pub const WITHOUT_CUT_ENV: &str = "RATELIMIT_BENCH_WITHOUT_CUT";

impl WithoutCut {
    /// Loads the object at `path` on `limiter`'s maps (a bucket store of `max_buckets`).
    pub fn load(path: &std::path::Path, limiter: &Limiter, max_buckets: u32) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        // The ELF parser wants the object 8-aligned (what `include_bytes_aligned!` gives the
        // agent's copy).
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` owns at least `bytes.len()` initialised bytes; u8 has no alignment.
        let aligned =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), bytes.len()) };
        aligned.copy_from_slice(&bytes);
        let mut ebpf = aya::EbpfLoader::new()
            .default_map_pin_directory(limiter.tdp.pin_dir())
            .map_max_entries(
                map_names::BUCKETS,
                ratelimit_common::bucket_capacity(max_buckets),
            )
            .map_max_entries(
                map_names::NEW_PAGES,
                ratelimit_common::new_pages_words(ratelimit_common::bucket_capacity(max_buckets)),
            )
            .load(aligned)
            .with_context(|| format!("loading {}", path.display()))?;
        let prog: &mut Xdp = ebpf
            .program_mut(ratelimit_common::PROGRAM_NAME)
            .context("no XDP program in the bench-only object")?
            .try_into()
            .context("not an XDP program")?;
        prog.load()
            .with_context(|| format!("verifying the program of {}", path.display()))?;
        Ok(Self { ebpf })
    }

    fn program(&self) -> &Xdp {
        self.ebpf
            .program(ratelimit_common::PROGRAM_NAME)
            .expect("loaded")
            .try_into()
            .expect("an XDP program")
    }
}

/// The whole-packet cost of the handling of cut packets (issue #11: at most 2 ns on the admitted
/// figure): the limiter and [`WithoutCut`] on the same whole frames, alternately within each run
/// (floor, then each case with and without), in one run of the bench. Each `.diff` figure's runs
/// are the paired differences (with - without) of one run. Skipped, saying so, when
/// [`WITHOUT_CUT_ENV`] is not set (the runner started by hand).
pub fn cut_ab(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    max_buckets: u32,
) -> Result<()> {
    let Some((path, without)) = variant(limiter, max_buckets) else {
        return Ok(());
    };
    let cases = cases();
    let floor_frame = v4_frame([198, 18, 0, 1]);
    for (_, _, frame) in &cases {
        repeat_ns(limiter.program(), frame, 1000)?;
        repeat_ns(without.program(), frame, 1000)?;
    }
    let mut floor = Vec::new();
    let mut runs = vec![AbRuns::default(); cases.len()];
    for run in 0..opts.runs {
        crate::session::check_interrupted()?;
        floor.push(repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?.0 + TRUNCATION);
        for ((_, _, frame), ab) in cases.iter().zip(&mut runs) {
            // Which goes first alternates from run to run.
            let order = if run % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for real in order {
                let prog = if real {
                    limiter.program()
                } else {
                    without.program()
                };
                let (k, _, action) = repeat_ns(prog, frame, opts.repeat)?;
                let (ns, at) = if real {
                    (&mut ab.with, &mut ab.with_action)
                } else {
                    (&mut ab.without, &mut ab.without_action)
                };
                ns.push(k + TRUNCATION);
                *at = action;
            }
        }
    }
    const FLOOR: &str = "kernel.cut_ab.floor";
    report.add(Figure {
        key: FLOOR.into(),
        section: SECTION_CUT,
        label: "floor: XDP_PASS, re-measured next to the A/B".into(),
        unit: "ns/pkt",
        runs: floor,
        baseline: None,
        detail: json!({ "repeat": opts.repeat }),
    });
    for ((name, what, _), ab) in cases.iter().zip(runs) {
        ab.report(report, opts, (name, what), FLOOR, &path.to_string_lossy());
    }
    Ok(())
}

/// The program without the handling of cut packets, loaded beside the limiter's maps, and where
/// it was built; `None`, said, where there is none to measure: [`WITHOUT_CUT_ENV`] not set, or
/// the variant does not load.
fn variant(limiter: &Limiter, max_buckets: u32) -> Option<(std::ffi::OsString, WithoutCut)> {
    let Some(path) = std::env::var_os(WITHOUT_CUT_ENV) else {
        eprintln!(
            "==> bench: {WITHOUT_CUT_ENV} not set (cargo xtask bench sets it): no A/B of the \
             handling of cut packets"
        );
        return None;
    };
    crate::session::announce(
        "in-kernel cost: whole packets with and without the handling of cut packets",
    );
    // The variant is another build of the program: the compiler lays it out on its own, and it
    // can fail the verifier where the agent's program passes (at e220dd3: "combined stack size of
    // 3 calls is 544"). The A/B is then not measured, said, and the rest of the bench runs.
    match WithoutCut::load(std::path::Path::new(&path), limiter, max_buckets) {
        Ok(w) => Some((path, w)),
        Err(e) => {
            eprintln!(
                "==> bench: no A/B of the handling of cut packets: the variant without it does \
                 not load: {}",
                format!("{e:#}").lines().next().unwrap_or_default()
            );
            None
        }
    }
}

/// The A/B's cases: name (in the keys), what it is (in the labels), the frame.
fn cases() -> [(&'static str, &'static str, Vec<u8>); 4] {
    [
        (
            "admitted",
            "known source, admitted",
            v4_frame([198, 18, 0, 1]),
        ),
        ("ipv6", "IPv6 known source, admitted", v6_frame()),
        ("allow_rule", "allow rule", v4_frame([198, 18, 3, 1])),
        ("no_match", "no rule matches", v4_frame([198, 19, 0, 1])),
    ]
}

/// One case's runs: ns with the handling (the agent's program) and without, and the action each
/// returned last.
#[derive(Clone, Default)]
struct AbRuns {
    with: Vec<f64>,
    without: Vec<f64>,
    with_action: u32,
    without_action: u32,
}

impl AbRuns {
    /// The case's three figures: without (over the floor), with (over without), and the paired
    /// difference.
    fn report(
        self,
        report: &mut Report,
        opts: &Options,
        (name, what): (&str, &str),
        floor: &str,
        object: &str,
    ) {
        let (k_with, k_without, k_diff) = cut_ab_keys(name);
        let diff: Vec<f64> = self
            .with
            .iter()
            .zip(&self.without)
            .map(|(a, b)| a - b)
            .collect();
        report.add(Figure {
            key: k_without.clone(),
            section: SECTION_CUT,
            label: format!("without the handling of cut packets: {what}"),
            unit: "ns/pkt",
            runs: self.without,
            baseline: Some(floor.into()),
            detail: json!({ "repeat": opts.repeat, "object": object, "xdp_action": action_name(self.without_action) }),
        });
        report.add(Figure {
            key: k_with,
            section: SECTION_CUT,
            label: format!("with it (the agent's program): {what}"),
            unit: "ns/pkt",
            runs: self.with,
            baseline: Some(k_without),
            detail: json!({ "repeat": opts.repeat, "xdp_action": action_name(self.with_action) }),
        });
        report.add(Figure {
            key: k_diff,
            section: SECTION_CUT,
            label: format!("difference, with - without, paired by run: {what}"),
            unit: "ns/pkt",
            runs: diff,
            baseline: None,
            detail: json!({}),
        });
    }
}

/// The keys of one [`cut_ab`] case: with, without, the paired difference.
pub fn cut_ab_keys(name: &str) -> (String, String, String) {
    (
        format!("kernel.cut_ab.{name}.with"),
        format!("kernel.cut_ab.{name}.without"),
        format!("kernel.cut_ab.{name}.diff"),
    )
}

const SECTION_CUT: &str =
    "Whole packets with and without the handling of cut packets, alternately (BPF_PROG_TEST_RUN)";
