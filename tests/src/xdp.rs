//! The real XDP program, loaded into the kernel under a throwaway pin directory, for running
//! frames through it with BPF_PROG_TEST_RUN and reading its counters.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result};
use aya::programs::{TestRun as _, TestRunOptions, Xdp};
use ratelimit::compile::{compile, CompiledRuleSet, RuleIds};
use ratelimit::config::Config;
use ratelimit::dataplane::{Dataplane, LoadOptions};
use ratelimit::maps::PinnedMaps;
use ratelimit_common::{GlobalStats, RuleStats, PROGRAM_NAME};

/// XDP_DROP.
pub const XDP_DROP: u32 = 1;
/// XDP_PASS.
pub const XDP_PASS: u32 = 2;

/// `bpf(2)` commands.
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A loaded program with its own pin directory, removed (maps unpinned) on drop.
pub struct TestDataplane {
    dp: Option<Dataplane>,
    ids: RuleIds,
    pin_dir: PathBuf,
    buckets_at_first_packet: bool,
}

impl TestDataplane {
    /// Loads the program with a bucket map of `max_buckets` under
    /// `/sys/fs/bpf/rl-test-<name>-<pid>-<n>`.
    pub fn new(name: &str, max_buckets: u32) -> Result<Self> {
        Self::with_object(name, max_buckets, None)
    }

    /// [`TestDataplane::new`] with the XDP object at `object` (a build variant, see
    /// [`variant_object`]) instead of the one built into the agent.
    pub fn with_object(name: &str, max_buckets: u32, object: Option<PathBuf>) -> Result<Self> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pin_dir = PathBuf::from(format!(
            "/sys/fs/bpf/rl-test-{name}-{}-{n}",
            std::process::id()
        ));
        let dp = Dataplane::load(&LoadOptions {
            pin_dir: pin_dir.clone(),
            max_buckets,
            object,
        })
        .with_context(|| format!("loading the XDP program under {}", pin_dir.display()))?;
        Ok(Self {
            dp: Some(dp),
            ids: RuleIds::new(),
            pin_dir,
            buckets_at_first_packet: false,
        })
    }

    /// The pin directory.
    #[must_use]
    pub fn pin_dir(&self) -> &std::path::Path {
        &self.pin_dir
    }

    /// The data plane.
    pub fn dataplane(&mut self) -> &mut Dataplane {
        self.dp.as_mut().expect("present until drop")
    }

    /// The pinned maps.
    #[must_use]
    pub fn maps(&self) -> &PinnedMaps {
        self.dp.as_ref().expect("present until drop").maps()
    }

    /// Installs a compiled rule set and commits its ids.
    pub fn install(&mut self, set: &CompiledRuleSet) -> Result<()> {
        self.dataplane().install(set)?;
        self.ids.commit(set)?;
        Ok(())
    }

    /// Compiles the `[[rule]]` tables in `toml` against the installed ids and installs them;
    /// returns the compiled set (for rule ids by name and the reference classifier).
    pub fn install_toml(&mut self, toml: &str) -> Result<CompiledRuleSet> {
        let config = Config::parse(toml, "test.toml")?;
        let mut set = compile(&config.rules, &self.ids)?;
        if self.buckets_at_first_packet {
            for r in &mut set.rules {
                without_first_free(&mut r.rule);
            }
        }
        self.install(&set)?;
        Ok(set)
    }

    /// From here on, [`TestDataplane::install_toml`] installs its rules with every key making its
    /// bucket at its first packet (see [`without_first_free`]): for tests of what a bucket's
    /// first packets do to the store (records, eviction, refunds), which the first-packet slots
    /// would otherwise keep them from.
    pub fn make_buckets_at_first_packet(&mut self) {
        self.buckets_at_first_packet = true;
    }

    /// The loaded XDP program (shareable between threads: test runs only need `&`).
    #[must_use]
    pub fn program(&self) -> &Xdp {
        self.dp
            .as_ref()
            .expect("present until drop")
            .ebpf()
            .program(PROGRAM_NAME)
            .expect("program in object")
            .try_into()
            .expect("an XDP program")
    }

    /// Runs `frame` through the program once and returns the XDP action.
    #[must_use]
    pub fn run(&self, frame: &[u8]) -> u32 {
        self.run_repeat(frame, 1).0
    }

    /// Runs `frame` `repeat` times (inside the kernel, on this CPU) and returns the last action
    /// and the kernel's average time per run.
    #[must_use]
    pub fn run_repeat(&self, frame: &[u8], repeat: u32) -> (u32, Duration) {
        let opts = TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::new()
        };
        let res = self.program().test_run(opts).expect("BPF_PROG_TEST_RUN");
        (res.return_value, res.duration)
    }

    /// A handle on the loaded program that runs frames without borrowing the data plane, so one
    /// thread can run packets while another installs rule sets.
    #[must_use]
    pub fn runner(&self) -> ProgramRunner {
        let fd = self
            .program()
            .fd()
            .expect("a loaded program")
            .try_clone()
            .expect("dup of the program fd");
        ProgramRunner(fd)
    }

    /// The program's cached coarse clock on CPU `cpu`: `(jiffies, ns)`, the first two words of
    /// its per-CPU scratch record (`RL_SCRATCH`, `Scratch::clock_jiffies` and `clock_ns`: the
    /// jiffy at which the program last read `bpf_ktime_get_coarse_ns`, and what it read).
    ///
    /// # Panics
    /// If the map is missing or the kernel refuses the lookup.
    #[must_use]
    pub fn coarse_cache(&self, cpu: usize) -> (u64, u64) {
        let (values, stride) = self.scratch_values();
        let at = cpu * stride;
        let word = |i: usize| {
            u64::from_ne_bytes(
                values[at + 8 * i..at + 8 * i + 8]
                    .try_into()
                    .expect("8 bytes"),
            )
        };
        (word(0), word(1))
    }

    /// Writes `(jiffies, ns)` as the program's cached coarse clock on CPU `cpu` (see
    /// [`TestDataplane::coarse_cache`]), the rest of the scratch record left as it is. A clock
    /// planted with the jiffy the program last saw is what the program reads for every packet
    /// until the jiffy changes: a coarse clock that lags the true time by what the test chooses.
    ///
    /// # Panics
    /// If the map is missing or the kernel refuses the update.
    pub fn set_coarse_cache(&self, cpu: usize, jiffies: u64, ns: u64) {
        let (mut values, stride) = self.scratch_values();
        let at = cpu * stride;
        values[at..at + 8].copy_from_slice(&jiffies.to_ne_bytes());
        values[at + 8..at + 16].copy_from_slice(&ns.to_ne_bytes());
        self.scratch_elem(BPF_MAP_UPDATE_ELEM, &mut values);
    }

    /// Every CPU's scratch record (raw bytes) and the stride between them.
    fn scratch_values(&self) -> (Vec<u8>, usize) {
        let stride = self.scratch_value_size().div_ceil(8) * 8;
        let cpus = aya::util::nr_cpus().expect("possible CPUs");
        let mut values = vec![0u8; stride * cpus];
        self.scratch_elem(BPF_MAP_LOOKUP_ELEM, &mut values);
        (values, stride)
    }

    fn scratch_map(&self) -> &aya::maps::MapData {
        let map = self
            .dp
            .as_ref()
            .expect("present until drop")
            .ebpf()
            .map("RL_SCRATCH")
            .expect("the program's scratch map");
        match map {
            aya::maps::Map::PerCpuArray(data) => data,
            _ => panic!("RL_SCRATCH is not a per-CPU array"),
        }
    }

    fn scratch_value_size(&self) -> usize {
        self.scratch_map().info().expect("map info").value_size() as usize
    }

    /// `BPF_MAP_LOOKUP_ELEM` or `BPF_MAP_UPDATE_ELEM` of the scratch map's one entry (key 0),
    /// with `values` every possible CPU's value.
    fn scratch_elem(&self, cmd: libc::c_long, values: &mut [u8]) {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        #[repr(C)]
        struct ElemAttr {
            map_fd: u32,
            _pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        let key = 0u32;
        let mut attr = ElemAttr {
            map_fd: u32::try_from(self.scratch_map().fd().as_fd().as_raw_fd()).expect("an fd"),
            _pad: 0,
            key: std::ptr::from_ref(&key) as u64,
            value: values.as_mut_ptr() as u64,
            flags: 0,
        };
        // SAFETY: `attr` is a valid bpf_attr prefix of the size given; `key` and `values` outlive
        // the call, and `values` holds a value for every possible CPU.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                std::ptr::from_mut(&mut attr),
                std::mem::size_of::<ElemAttr>(),
            )
        };
        assert_eq!(
            rc,
            0,
            "bpf({cmd}) on RL_SCRATCH: {}",
            std::io::Error::last_os_error()
        );
    }

    /// Global counters summed over CPUs.
    #[must_use]
    pub fn global(&self) -> GlobalStats {
        self.maps().global_stats().expect("global stats")
    }

    /// Counters of rule `id` summed over CPUs.
    #[must_use]
    pub fn rule(&self, id: u32) -> RuleStats {
        self.maps().rule_stats(id).expect("rule stats")
    }
}

impl Drop for TestDataplane {
    fn drop(&mut self) {
        if let Some(dp) = self.dp.take() {
            if let Err(e) = dp.remove() {
                eprintln!("removing test data plane {}: {e}", self.pin_dir.display());
            }
        }
    }
}

/// Runs `frame` through `dp` `n` times (one test run each) and counts the passes.
pub fn passes(dp: &TestDataplane, frame: &[u8], n: usize) -> usize {
    (0..n).filter(|_| dp.run(frame) == XDP_PASS).count()
}

/// Pins the calling thread to `cpu`.
///
/// # Errors
/// When the kernel refuses (no such CPU).
pub fn pin_to_cpu(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_setaffinity(0, ..) applies to the calling thread.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The loaded program's own descriptor (see [`TestDataplane::runner`]): runs frames through it
/// with `BPF_PROG_TEST_RUN`, issued directly (aya's `test_run` needs the program object).
pub struct ProgramRunner(aya::programs::ProgramFd);

/// `union bpf_attr`'s `test` member (linux/bpf.h), up to `batch_size`, and the 4 bytes that
/// pad it to 8: the kernel refuses (`EINVAL`) an attribute with any byte past the command's last
/// field set, and left implicit, those 4 were whatever the stack held (runs failed or not with
/// the tests that ran before on the thread).
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}
const _: () = assert!(std::mem::size_of::<TestRunAttr>() == 80);

impl ProgramRunner {
    /// Runs `frame` `repeat` times on this CPU and returns the last XDP action.
    ///
    /// # Panics
    /// If the kernel refuses the run.
    #[must_use]
    pub fn run_repeat(&self, frame: &[u8], repeat: u32) -> u32 {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        const BPF_PROG_TEST_RUN: libc::c_long = 10;
        let mut attr = TestRunAttr {
            prog_fd: u32::try_from(self.0.as_fd().as_raw_fd()).expect("a valid fd"),
            data_size_in: u32::try_from(frame.len()).expect("a frame"),
            data_in: frame.as_ptr() as u64,
            repeat,
            ..TestRunAttr::default()
        };
        // SAFETY: `attr` is a valid bpf_attr prefix of the size given; `data_in` points at
        // `frame`, which outlives the call; no output buffers are passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_TEST_RUN,
                std::ptr::from_mut(&mut attr),
                std::mem::size_of::<TestRunAttr>(),
            )
        };
        assert_eq!(
            rc,
            0,
            "BPF_PROG_TEST_RUN: {}",
            std::io::Error::last_os_error()
        );
        attr.retval
    }
}

/// How the XDP program is built, shared with ratelimit-userspace/build.rs and xtask.
mod ebpf_build {
    include!("../../ratelimit-ebpf/nightly_build.rs");
}

/// Builds the XDP program with ratelimit-ebpf's test-only `feature` (e.g. `test-cas-once`) and
/// returns the object's path: as ratelimit-userspace/build.rs builds the real one (the same
/// command, so the two differ only by the feature), in a target dir of its own per feature
/// (target/ebpf-variant-FEATURE), once per test process.
pub fn variant_object(feature: &str) -> Result<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, path)) = built.iter().find(|(f, _)| f == feature) {
        return Ok(path.clone());
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate has a parent")?
        .to_path_buf();
    let target_dir = workspace
        .join("target")
        .join(format!("ebpf-variant-{feature}"));
    let mut cmd = ebpf_build::ebpf_build(&workspace, &target_dir, &[feature]);
    let out = cmd
        .output()
        .context("running `rustup run nightly cargo build` for ratelimit-ebpf")?;
    if !out.status.success() {
        anyhow::bail!(
            "building the XDP program with feature {feature} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = ebpf_build::ebpf_object(&target_dir);
    built.push((feature.to_owned(), path.clone()));
    Ok(path)
}

/// Makes rule `id` cluster-scoped in `maps`, as the compiler does for `scope = "cluster"` (which
/// the config takes only beside a `[cluster]` table, and a test dataplane runs no cluster), and
/// returns its record as written.
///
/// # Errors
/// When the rule record cannot be read or written.
pub fn make_cluster_scoped(maps: &mut PinnedMaps, id: u32) -> Result<ratelimit_common::Rule> {
    use ratelimit_common::rule_flags::{BORN_COARSE, CLUSTER, FIRST_FREE};
    let mut rule = maps.rule(id)?;
    // As the agent compiles `scope = "cluster"`: such a limit's buckets are made on the precise
    // clock (the share arithmetic keeps TATs of its own), and its keys' first packets make them.
    rule.flags = rule.flags & !(BORN_COARSE | FIRST_FREE) | CLUSTER;
    maps.set_rule(id, rule)?;
    Ok(rule)
}

/// Makes rule `id`'s keys make their buckets at their first packet, clearing
/// `rule_flags::FIRST_FREE` in its record (and its extra limits'): for tests whose account starts
/// at a bucket's creation. Returns the record as written.
///
/// # Errors
/// When the rule record cannot be read or written.
pub fn making_buckets(maps: &mut PinnedMaps, id: u32) -> Result<ratelimit_common::Rule> {
    let mut rule = maps.rule(id)?;
    without_first_free(&mut rule);
    maps.set_rule(id, rule)?;
    Ok(rule)
}

/// Clears `rule_flags::FIRST_FREE` in `rule`'s flags and its extra limits': each key of the rule
/// makes its bucket at its first packet, as before the first-packet slots.
pub fn without_first_free(rule: &mut ratelimit_common::Rule) {
    use ratelimit_common::rule_flags::FIRST_FREE;
    rule.flags &= !FIRST_FREE;
    for l in &mut rule.extra {
        l.flags &= !FIRST_FREE;
    }
}

/// Runs each of `frames` once on each of two CPUs at the same instant (a spin barrier before
/// each frame, one thread pinned to each CPU): the XDP action of each frame on CPU 0 and 1.
///
/// # Panics
/// With fewer than two CPUs, or if a thread cannot be pinned.
pub fn on_two_cpus_at_once(dp: &TestDataplane, frames: &[Vec<u8>]) -> Vec<[u32; 2]> {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    assert!(cpus >= 2, "needs two CPUs");
    let step = Lockstep::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|cpu| {
                let (step, runner) = (&step, dp.runner());
                s.spawn(move || {
                    pin_to_cpu(cpu).unwrap_or_else(|e| panic!("pin to CPU {cpu}: {e}"));
                    (0u32..)
                        .zip(frames)
                        .map(|(i, f)| {
                            step.wait(i);
                            runner.run_repeat(f, 1)
                        })
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        let mut each = workers.into_iter().map(|w| w.join().unwrap());
        let (c0, c1) = (each.next().unwrap(), each.next().unwrap());
        c0.into_iter().zip(c1).map(|(a, b)| [a, b]).collect()
    })
}

/// A spin barrier for two threads stepping through the same list: `wait(i)` returns once both
/// have reached step `i`.
#[derive(Default)]
pub struct Lockstep(std::sync::atomic::AtomicU32);

impl Lockstep {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
    pub fn wait(&self, i: u32) {
        use std::sync::atomic::Ordering;
        self.0.fetch_add(1, Ordering::AcqRel);
        while self.0.load(Ordering::Acquire) < 2 * (i + 1) {
            std::hint::spin_loop();
        }
    }
}
