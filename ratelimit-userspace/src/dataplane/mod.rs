//! The data plane: loads the XDP program with its maps pinned under bpffs, attaches it to
//! interfaces, swaps rule sets in atomically and reads the counters back.
//!
//! A rule set is installed under the inactive *generation* of the prefix trie and then made live by
//! flipping one word in the config map, so a packet sees either the old set or the new one whole.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
        Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use ratelimit_common::{
    action, bucket_capacity, config_flags, global, map_names, prefix_generation, PrefixKey, Rule,
    RuleSet, BUCKET_WAYS, MAX_RULES, PROGRAM_NAME,
};

use crate::compile::CompiledRuleSet;
pub use crate::config::AttachMode;
use crate::maps::{self, MapsError, PinnedMaps};

/// The compiled XDP object, built by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ratelimit.bpf.o"));

/// The compiled XDP object (for benchmarks that load its reference programs `bench_pass`,
/// `bench_drop` and `bench_tx`).
#[must_use]
pub fn object() -> &'static [u8] {
    OBJECT
}

/// How long to wait after a generation flip before deleting the old generation: XDP programs run
/// under RCU, so any packet that read the old generation number has finished well within this.
const GRACE: Duration = Duration::from_millis(20);

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
    /// The exclusive lock on the pin directory (see [`prepare_pin_dir`]), held until the data plane
    /// is dropped or removed.
    lock: fs::File,
}

impl Dataplane {
    /// Loads the program, creating (or reusing) the pinned maps under `opts.pin_dir`.
    pub fn load(opts: &LoadOptions) -> Result<Self> {
        if OBJECT.is_empty() {
            return Err(DataplaneError::NoObject);
        }
        ensure_bpffs(&opts.pin_dir)?;
        warn_if_private_bpffs(&opts.pin_dir);
        // Locked before anything in the directory is read or written: another agent's pins are
        // its own.
        let (fresh, lock) = prepare_pin_dir(&opts.pin_dir)?;
        let loaded = Self::load_pinned(opts, lock);
        if loaded.is_err() && fresh {
            // We created the pins: a failed load leaves nothing behind.
            let _ = maps::remove_pins(&opts.pin_dir);
        }
        loaded
    }

    fn load_pinned(opts: &LoadOptions, lock: fs::File) -> Result<Self> {
        maps::check_pinned(&opts.pin_dir, opts.max_buckets)?;
        let other = match &opts.object {
            Some(path) => Some(fs::read(path).map_err(|e| {
                DataplaneError::Load(format!("reading the XDP object {}: {e}", path.display()))
            })?),
            None => None,
        };
        // How far the program's coarse clock may lag the true time on this kernel: several of its
        // ticks (see `ratelimit_common::COARSE_LAG_TICKS`). Not required of the object (one built
        // before the global keeps its own constant).
        let coarse_lag = ratelimit_common::coarse_lag_ns(crate::maps::bucket::coarse_tick_ns());
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&opts.pin_dir)
            .map_max_entries(map_names::BUCKETS, bucket_capacity(opts.max_buckets))
            .override_global(ratelimit_common::COARSE_LAG_GLOBAL, &coarse_lag, false)
            .load(other.as_deref().unwrap_or(OBJECT))
            .map_err(|e| DataplaneError::Load(format!("{e:#}")))?;
        let program = xdp_program(&mut ebpf)?;
        program
            .load()
            .map_err(|e| DataplaneError::Load(verifier_error(&e)))?;
        let mut maps = PinnedMaps::open(&opts.pin_dir)?;
        init_store(&mut maps)?;
        let live_ids = IdSet::from_ids(maps.named_rules()?.into_keys());
        Ok(Self {
            ebpf,
            maps,
            attachments: Vec::new(),
            live_ids,
            records: Vec::new(),
            mirror: None,
            internal_at_install: None,
            lock,
        })
    }

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

    /// Attaches to `iface`. In [`AttachMode::Auto`], native mode is tried first and generic mode
    /// used where the driver refuses. If a previous agent left a pinned link for `iface` in the
    /// pin directory, that link is switched over to this program atomically instead (no packet
    /// goes unlimited in between) and `mode` is ignored.
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<&Attachment> {
        if !interface_exists(iface) {
            return Err(DataplaneError::NoSuchInterface(iface.to_string()));
        }
        let pin = self.pin_dir().join(link_pin_name(iface));
        if pin.exists() {
            return self.adopt(iface, pin);
        }
        let tries: &[(XdpMode, &'static str)] = match mode {
            AttachMode::Auto => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "skb")],
            AttachMode::Native => &[(XdpMode::Driver, "native")],
            AttachMode::Skb => &[(XdpMode::Skb, "skb")],
        };
        let program = xdp_program(&mut self.ebpf)?;
        let mut last = None;
        for &(xdp_mode, name) in tries {
            let attach_err = |reason: String| DataplaneError::Attach {
                iface: iface.to_string(),
                mode: name,
                reason,
            };
            match program.attach(iface, xdp_mode) {
                Ok(id) => {
                    let link = program
                        .take_link(id)
                        .map_err(|e| attach_err(error_chain(&e)))?;
                    // Only a bpf_link can be pinned; aya falls back to netlink on kernels without
                    // XDP links (< 5.9), which this agent does not support.
                    let link = FdLink::try_from(link).map_err(|e| {
                        attach_err(format!(
                            "not a bpf_link (kernel too old?): {}",
                            error_chain(&e)
                        ))
                    })?;
                    let pinned = link.pin(&pin).map_err(|e| {
                        attach_err(format!("pinning the link at {}: {e}", pin.display()))
                    })?;
                    let link = FdLink::from(pinned);
                    let ifindex = ifindex(iface);
                    if name == "skb" && gro_enabled(iface) == Some(true) {
                        // The kernel runs a generic XDP program after GRO, once per merged
                        // buffer: up to 64 segments of a TCP flow then take one packet token.
                        tracing::warn!(
                            iface,
                            "attached in skb (generic) mode with GRO on: a packet limit counts \
                             each buffer GRO merged as one packet (up to 64 segments of a TCP \
                             flow), so it admits up to that many times its rate of such traffic; \
                             byte limits count every byte. Native mode sees every frame; or turn \
                             GRO off (`ethtool -K {iface} gro off`)"
                        );
                    }
                    self.attachments.push(Attachment {
                        iface: iface.to_string(),
                        mode: name,
                        ifindex,
                        link,
                        pin,
                    });
                    return Ok(self.attachments.last().expect("just pushed"));
                }
                Err(e) => {
                    tracing::debug!(iface, mode = name, error = %e, "attach failed");
                    if matches!(os_error(&e), Some(libc::EBUSY | libc::EEXIST)) {
                        // EBUSY: a program is attached in this mode; EEXIST: in the other mode.
                        // Either way no other mode can help.
                        return Err(attach_err(format!(
                            "{iface} already has an XDP program attached (another ratelimit agent \
                             with another pin_path, or another XDP tool; `ip link show dev {iface}` \
                             shows it): detach it first ({})",
                            error_chain(&e)
                        )));
                    }
                    last = Some(attach_err(error_chain(&e)));
                }
            }
        }
        Err(last.expect("at least one mode tried"))
    }

    /// Switches the link a previous agent pinned for `iface` over to this program.
    fn adopt(&mut self, iface: &str, pin: PathBuf) -> Result<&Attachment> {
        let attach_err = |reason: String| DataplaneError::Attach {
            iface: iface.to_string(),
            mode: "adopted",
            reason,
        };
        let old = PinnedLink::from_pin(&pin).map_err(|e| {
            attach_err(format!(
                "opening pinned link {}: {}",
                pin.display(),
                error_chain(&e)
            ))
        })?;
        let link = XdpLink::try_from(FdLink::from(old)).map_err(|e| {
            attach_err(format!(
                "pinned link {} is not an XDP link: {}",
                pin.display(),
                error_chain(&e)
            ))
        })?;
        let program = xdp_program(&mut self.ebpf)?;
        // bpf_link_update: the interface runs the old program until this call and ours after it.
        let id = program
            .attach_to_link(link)
            .map_err(|e| attach_err(error_chain(&e)))?;
        let link = program
            .take_link(id)
            .map_err(|e| attach_err(error_chain(&e)))?;
        let link = FdLink::try_from(link).map_err(|e| attach_err(error_chain(&e)))?;
        let ifindex = ifindex(iface);
        // One record per interface: adopting a link this agent already holds replaces its record.
        self.attachments.retain(|a| a.iface != iface);
        self.attachments.push(Attachment {
            iface: iface.to_string(),
            mode: "adopted",
            ifindex,
            link,
            pin,
        });
        Ok(self.attachments.last().expect("just pushed"))
    }

    /// Whether the interface the program was attached to as `iface` is still there (`None`: not
    /// attached to `iface`). By interface index: an interface created again in the same instant
    /// with the same index would go unnoticed, which the kernel's cyclic index allocation makes
    /// unlikely.
    #[must_use]
    pub fn link_health(&self, iface: &str) -> Option<LinkHealth> {
        let att = self.attachments.iter().find(|a| a.iface == iface)?;
        Some(match ifindex(iface) {
            0 => LinkHealth::Missing,
            now if now == att.ifindex => LinkHealth::Attached,
            _ => LinkHealth::Replaced,
        })
    }

    /// Attaches to `iface` afresh, after the interface it was attached to went away (see
    /// [`Dataplane::link_health`]): the defunct link and its pin are dropped first.
    pub fn reattach(&mut self, iface: &str, mode: AttachMode) -> Result<&Attachment> {
        self.detach(iface)?;
        self.attach(iface, mode)
    }

    /// Detaches from `iface` (removes its pinned link); returns whether it was attached.
    pub fn detach(&mut self, iface: &str) -> Result<bool> {
        let Some(pos) = self.attachments.iter().position(|a| a.iface == iface) else {
            return Ok(false);
        };
        let att = self.attachments.remove(pos);
        remove_link_pin(&att.pin)?;
        // Closing the last reference to an unpinned link detaches the program.
        drop(att.link);
        Ok(true)
    }

    /// Detaches from every interface.
    pub fn detach_all(&mut self) -> Result<()> {
        let ifaces: Vec<String> = self.attachments.iter().map(|a| a.iface.clone()).collect();
        for iface in ifaces {
            self.detach(&iface)?;
        }
        Ok(())
    }

    /// Leaves every attachment, map and pin in place and lets go of them: the limiter keeps
    /// enforcing with the rules in force, and the next agent adopts it all.
    pub fn keep_attached(self) {
        drop(self);
    }

    /// Detaches everything, unloads the program and removes the pinned maps.
    pub fn remove(mut self) -> Result<()> {
        self.detach_all()?;
        let dir = self.pin_dir().to_path_buf();
        // The lock goes last, so that no other agent adopts a directory being emptied.
        let Self {
            ebpf,
            maps,
            attachments,
            lock,
            ..
        } = self;
        drop((ebpf, maps, attachments));
        let removed = remove_pin_dir(&dir);
        drop(lock);
        removed
    }

    /// Makes `rules`/`prefixes` the rule set in force, atomically: written under the inactive
    /// generation, then switched to with one word. Buckets of rules that left the set go stale
    /// (their generation ends), so their ids can be reused with a clean slate; buckets of rules
    /// that stayed keep their level.
    ///
    /// Both generations hold the set in force between installs (the old one is brought up to
    /// the new set after the switch), so an install writes only what changed: a change of one
    /// rule among 10,000 is a few map writes and the grace period, not the whole set twice. What
    /// was written is kept in memory (records by id, the prefixes as one sorted list), so
    /// finding the change costs a comparison per rule and per prefix, no map read.
    ///
    /// When the program counted an internal error since the last install (a prefix naming a
    /// rule id without a record: a state the agent never writes), nothing written is trusted:
    /// every rule record and both generations of the trie are written again, which repairs
    /// whatever was overwritten.
    pub fn install(&mut self, set: &CompiledRuleSet) -> Result<()> {
        // Before anything is written: an id the rule map has no record for fails the install
        // here, not half-way (the compiler never assigns one).
        if let Some(r) = set.rules.iter().find(|r| r.id >= MAX_RULES) {
            return Err(MapsError::Op {
                map: map_names::RULES,
                reason: format!(
                    "rule {:?} has id {}, beyond the last ({})",
                    r.name,
                    r.id,
                    MAX_RULES - 1
                ),
            }
            .into());
        }
        let internal = self.maps.global_stats()?.counters[global::INTERNAL];
        if self
            .internal_at_install
            .is_some_and(|seen| seen != internal)
        {
            tracing::warn!(
                internal,
                "the XDP program counted internal errors since the last install: rewriting every \
                 rule record and prefix"
            );
            self.records.clear();
            self.mirror = None;
        }
        let config = self.maps.config()?;
        // A new epoch (it keys the XDP program's classification cache); its low bit is the
        // inactive half of the prefix trie.
        let epoch = config.generation.wrapping_add(1);
        let next = prefix_generation(epoch);
        let new_ids = IdSet::from_ids(set.rules.iter().map(|r| r.id));

        // 1. Rule records. An id in force keeps its content (a changed rule gets a new id), so
        //    rewriting it changes nothing a packet can see; a new id starts with zeroed counters
        //    and a new bucket generation (the epoch being installed: unique, never 0), so no
        //    bucket of the id's last rule counts for it. A record known to hold what it should
        //    (an unchanged rule) is not touched: it costs a comparison, no map access.
        for r in &set.rules {
            let line = u32::try_from(r.line).unwrap_or(0);
            // A fresh rule (an id the agent hands out anew) starts clean even if the id was not
            // retired yet (a retirement that failed after a switch): never another rule's
            // buckets or counters.
            let live = self.live_ids.contains(r.id) && !r.fresh;
            let known = written(&self.records, r.id).filter(|_| live);
            let mut record = r.rule;
            record.bucket_gen = match known {
                Some(k) => k.rule.bucket_gen,
                None if live => self.maps.rule(r.id)?.bucket_gen,
                None => 0,
            };
            if record.bucket_gen == 0 {
                record.bucket_gen = epoch.max(1);
            }
            let (same_record, same_meta) = known.map_or((false, false), |k| {
                (k.rule == record, k.name == r.name && k.line == line)
            });
            if same_record && same_meta {
                continue;
            }
            if !live {
                self.maps.reset_rule_stats(r.id)?;
            }
            // Forgotten first: a write that fails leaves the record unknown, rewritten next time.
            remember(&mut self.records, r.id, None);
            if !same_record {
                self.maps.set_rule(r.id, record)?;
            }
            if !same_meta {
                self.maps.set_rule_meta(r.id, Some((&r.name, line)))?;
            }
            remember(
                &mut self.records,
                r.id,
                Some(Written {
                    rule: record,
                    name: r.name.clone(),
                    line,
                }),
            );
        }
        // 2. The inactive generation: brought from the set both generations hold to the new one
        //    by writing the difference (or, not known, cleared of whatever it holds, say a crash
        //    mid-install's, and filled). The difference is worked out once, for both.
        let new = mirror_of(set);
        let old = self.mirror.take();
        let diff = old.as_deref().map(|old| PrefixDiff::between(old, &new));
        let table = set.v4_table();
        self.write_generation(next, diff.as_ref(), &new, &table)?;
        // 3. The switch, with whether a rule that can drop is in force (a frame in more VLAN
        //    tags than the program walks is dropped only then: `global::DROPPED_VLAN_CHAINS`).
        let dropping = set.rules.iter().any(|r| r.rule.action != action::ALLOW);
        self.maps.update_config(|c| {
            c.generation = epoch;
            c.flags = with_dropping_rules(c.flags, dropping);
        })?;
        // From here on the new set is in force, whatever fails below: the install is done (the
        // agent reports the new rules), and what is left undone is finished by the next install
        // (the other half, unknown, is cleared and written whole; ids not yet retired stay live
        // until they are). A failure is logged, naming what is left.
        match self.after_switch(next, diff.as_ref(), new, &table, new_ids) {
            Ok(()) => {
                // Only once it all was written: an install that failed half-way repairs next
                // time.
                self.internal_at_install = Some(internal);
            }
            Err(e) => tracing::warn!(
                error = %e,
                "the new rules are in force, but bringing the other half of the prefix table                  to them, or retiring the ids of removed rules, failed; the next install                  finishes it"
            ),
        }
        Ok(())
    }

    /// [`Self::install`]'s steps after the switch to generation `next`: once no packet can still
    /// be reading the other generation, brings it to the new set too (`new`, from `diff` if
    /// known), then retires the ids of rules that left the set (`new_ids` the set's).
    fn after_switch(
        &mut self,
        next: u8,
        diff: Option<&PrefixDiff>,
        new: Vec<(MirrorKey, RuleSet)>,
        table: &[u32],
        new_ids: IdSet,
    ) -> Result<()> {
        thread::sleep(GRACE);
        fail::fail_point!("dataplane-after-switch", |_| Err(MapsError::Op {
            map: map_names::PREFIXES,
            reason: "failpoint dataplane-after-switch".into(),
        }
        .into()));
        self.write_generation(1 - next, diff, &new, table)?;
        self.mirror = Some(new);
        // Rules that left the set: their buckets go stale with their generation (readers ignore
        // them, the program recycles their records), so nothing is walked or deleted. An id stays
        // live until it is retired, so a failure here is retried by the next install.
        let gone: Vec<u32> = self
            .live_ids
            .iter()
            .filter(|&id| !new_ids.contains(id))
            .collect();
        let mut live = new_ids;
        for (i, &id) in gone.iter().enumerate() {
            if let Err(e) = self.retire(id) {
                for &left in &gone[i..] {
                    live.insert(left);
                }
                self.live_ids = live;
                return Err(e);
            }
        }
        self.live_ids = live;
        Ok(())
    }

    /// Retires rule id `id` (its rule left the set): no name, bucket generation 0.
    fn retire(&mut self, id: u32) -> Result<()> {
        let rule = match self.records.get_mut(id as usize).and_then(Option::take) {
            Some(w) => w.rule,
            None => self.maps.rule(id)?,
        };
        fail::fail_point!("dataplane-retire", |_| Err(MapsError::Op {
            map: map_names::RULES,
            reason: "failpoint dataplane-retire".into(),
        }
        .into()));
        self.maps.set_rule_meta(id, None)?;
        self.maps.set_rule(
            id,
            ratelimit_common::Rule {
                bucket_gen: 0,
                ..rule
            },
        )?;
        Ok(())
    }

    /// Makes `generation` of the prefix trie hold exactly `new`: from the set both generations
    /// held by writing `diff`, removals first so it never holds more than the larger set; from
    /// unknown contents (`None`) by clearing it and writing every entry. Then that half of the
    /// IPv4 table holds `table` (`CompiledRuleSet::v4_table`; compared word by word, in memory).
    fn write_generation(
        &mut self,
        generation: u8,
        diff: Option<&PrefixDiff>,
        new: &[(MirrorKey, RuleSet)],
        table: &[u32],
    ) -> Result<()> {
        match diff {
            Some(diff) => {
                let gone: Vec<_> = diff.gone.iter().map(|k| k.at(generation)).collect();
                self.maps.remove_prefixes(&gone)?;
                for (k, rules) in &diff.set {
                    let (key, len) = k.at(generation);
                    self.maps.insert_prefix(key, len, *rules)?;
                }
            }
            None => {
                self.maps.clear_generation(generation)?;
                for (k, rules) in new {
                    let (key, len) = k.at(generation);
                    self.maps.insert_prefix(key, len, *rules)?;
                }
            }
        }
        self.maps.v4_table().write_half(generation, table);
        Ok(())
    }

    /// Sets the global [`ratelimit_common::config_flags`] the agent's settings decide; whether a
    /// rule that can drop is in force ([`config_flags::DROPPING_RULES`]) goes with the rule set
    /// installed, and is kept.
    pub fn set_flags(&mut self, flags: u32) -> Result<()> {
        self.maps.update_config(|c| {
            c.flags = with_dropping_rules(flags, c.flags & config_flags::DROPPING_RULES != 0);
        })?;
        Ok(())
    }
}

/// `flags` with [`config_flags::DROPPING_RULES`] set to `dropping`.
fn with_dropping_rules(flags: u32, dropping: bool) -> u32 {
    if dropping {
        flags | config_flags::DROPPING_RULES
    } else {
        flags & !config_flags::DROPPING_RULES
    }
}

/// What the data plane wrote to a rule record and its name.
struct Written {
    /// The record, with its bucket generation.
    rule: Rule,
    /// The rule's name.
    name: String,
    /// The rule's config line.
    line: u32,
}

/// What `records` knows was written for rule `id`.
fn written(records: &[Option<Written>], id: u32) -> Option<&Written> {
    records.get(id as usize).and_then(Option::as_ref)
}

/// Sets (or, `None`, forgets) what `records` knows was written for rule `id` (< [`MAX_RULES`]).
fn remember(records: &mut Vec<Option<Written>>, id: u32, what: Option<Written>) {
    let i = id as usize;
    if i >= records.len() {
        if what.is_none() {
            return;
        }
        records.resize_with(i + 1, || None);
    }
    records[i] = what;
}

/// A set of rule ids (< [`MAX_RULES`]): one bit each.
#[derive(Clone, Debug)]
struct IdSet(Vec<u64>);

impl IdSet {
    fn from_ids(ids: impl IntoIterator<Item = u32>) -> Self {
        let mut bits = vec![0u64; MAX_RULES.div_ceil(64) as usize];
        for id in ids {
            if id < MAX_RULES {
                bits[(id / 64) as usize] |= 1 << (id % 64);
            }
        }
        Self(bits)
    }

    fn contains(&self, id: u32) -> bool {
        self.0
            .get((id / 64) as usize)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    fn insert(&mut self, id: u32) {
        if let Some(w) = self.0.get_mut((id / 64) as usize) {
            *w |= 1 << (id % 64);
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..MAX_RULES).filter(|&id| self.contains(id))
    }
}

/// A prefix trie entry's key apart from its generation: what both generations hold alike.
/// Ordered by family, address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct MirrorKey {
    family: u8,
    addr: [u8; 16],
    /// The LPM prefix length (header bits included).
    prefix_len: u32,
}

impl MirrorKey {
    /// The trie key (data, LPM prefix length) under `generation`.
    fn at(self, generation: u8) -> (PrefixKey, u32) {
        (
            PrefixKey {
                generation,
                family: self.family,
                addr: self.addr,
            },
            self.prefix_len,
        )
    }
}

/// The prefix entries of `set` as both generations hold them, sorted by key; a key given twice
/// holds the later entry's rules, as the trie would after writing both.
fn mirror_of(set: &CompiledRuleSet) -> Vec<(MirrorKey, RuleSet)> {
    let mut entries: Vec<(MirrorKey, RuleSet)> = set
        .prefixes
        .iter()
        .map(|p| {
            let key = MirrorKey {
                family: p.family,
                addr: p.addr,
                prefix_len: p.lpm_prefix_len(),
            };
            (key, p.rules)
        })
        .collect();
    // The compiler hands them over in this order already: the check is one pass.
    if !entries.is_sorted_by_key(|e| e.0) {
        entries.sort_by_key(|e| e.0);
    }
    entries.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 = later.1;
        }
        same
    });
    entries
}

/// What turns one set of prefix entries into another: one merge of the two sorted lists, so a
/// change of one prefix among many costs a comparison per entry and a map write for that one.
#[derive(Debug, Default, PartialEq, Eq)]
struct PrefixDiff {
    /// Keys of the old set that the new one lacks.
    gone: Vec<MirrorKey>,
    /// Entries of the new set that the old one lacks or holds with other rules.
    set: Vec<(MirrorKey, RuleSet)>,
}

impl PrefixDiff {
    /// From `old` to `new`, both sorted by key without repeats (see [`mirror_of`]).
    fn between(old: &[(MirrorKey, RuleSet)], new: &[(MirrorKey, RuleSet)]) -> Self {
        use std::cmp::Ordering;
        let mut diff = Self::default();
        let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
        loop {
            match (o.peek(), n.peek()) {
                (Some(a), Some(b)) => match a.0.cmp(&b.0) {
                    Ordering::Less => {
                        diff.gone.push(a.0);
                        o.next();
                    }
                    Ordering::Greater => {
                        diff.set.push(**b);
                        n.next();
                    }
                    Ordering::Equal => {
                        if a.1 != b.1 {
                            diff.set.push(**b);
                        }
                        o.next();
                        n.next();
                    }
                },
                (Some(a), None) => {
                    diff.gone.push(a.0);
                    o.next();
                }
                (None, Some(b)) => {
                    diff.set.push(**b);
                    n.next();
                }
                (None, None) => return diff,
            }
        }
    }
}

/// Gives a bucket store its secret seed and its number of sets, once: a store adopted from an
/// earlier agent keeps the seed it was filled under, or its buckets could not be found again.
fn init_store(maps: &mut PinnedMaps) -> Result<()> {
    let config = maps.config()?;
    let sets = maps.bucket_capacity()? / BUCKET_WAYS;
    if config.seed != [0, 0] && config.bucket_sets == sets {
        return Ok(());
    }
    // New pins: this version's layout stamp goes with the seed.
    let mut seed = [0u64; 2];
    while seed == [0, 0] {
        let mut bytes = [0u8; 16];
        // SAFETY: writes at most 16 bytes into `bytes`.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if n != 16 {
            return Err(DataplaneError::Load(format!(
                "drawing the bucket store's seed: {}",
                std::io::Error::last_os_error()
            )));
        }
        seed = [
            u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
        ];
    }
    maps.update_config(|c| {
        c.seed = seed;
        c.bucket_sets = sets;
        c.layout = ratelimit_common::layout::STAMP;
    })?;
    Ok(())
}

/// How many times [`own_dir`] looks at a name again after moving aside what it found there. One
/// look normally settles it: what [`quarantine`] swaps in is a fresh directory of the agent's own,
/// which no other user can move in a sticky parent (a bpffs root always is).
const PIN_DIR_TRIES: u32 = 64;

/// Makes `dir` the agent's own pin directory and locks it: a directory owned by this agent's
/// user, mode 0700, so that no other user can open it, take its lock or touch the pins in it.
/// Anything else found at its path, or at a path of a directory below the bpffs mount that leads
/// to it (anyone may create entries in a bpffs mounted with the kernel's default mode 1777: a
/// symlink, a directory of another user, a directory holding entries that are not this user's
/// pins, one locked by a process of another user or while others could open it), is neither
/// followed nor used nor obeyed: it is moved aside to a `NAME_quarantine_PID_RANDOM` name in the
/// same parent, with a warning, and a fresh directory takes its place in the same rename (no
/// window for anyone to plant another).
/// Nothing is opened by path below the bpffs mount: each step is relative to a verified
/// descriptor of its parent, and no symlink is followed. A directory of this user, mode 0700,
/// is kept with its pins (an earlier agent's, to adopt). Returns whether the directory is new,
/// and the descriptor that holds the lock.
///
/// The lock is an exclusive `flock`, so that one agent at a time uses the directory: a second
/// agent started with the same `pin_path` (but another socket) would otherwise adopt the first's
/// maps and links, replace its rules, and unpin everything when it exits. The kernel drops the
/// lock when the holder exits, crash included, so a stale lock cannot block a restart.
fn prepare_pin_dir(dir: &Path) -> Result<(bool, fs::File)> {
    use std::os::unix::fs::MetadataExt as _;
    let io_err = |what, source| DataplaneError::Io {
        what,
        path: dir.to_path_buf(),
        source,
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let (mut parent, mut parent_path, names) =
        walk_start(dir).map_err(|e| io_err("opening the parent of pin directory", e))?;
    let Some((last, middle)) = names.split_last() else {
        return Err(io_err(
            "using pin directory",
            std::io::Error::other("it is the bpffs mount itself: name a directory below it"),
        ));
    };
    for name in middle {
        parent_path.push(name);
        parent = own_dir(&parent, name, &parent_path, euid, false)?.1;
    }
    let (fresh, file) = own_dir(&parent, last, dir, euid, true)?;
    // What the path names is what was verified and locked (the agent pins by path).
    let by_path = fs::symlink_metadata(dir).map_err(|e| io_err("inspecting pin directory", e))?;
    let held = file
        .metadata()
        .map_err(|e| io_err("inspecting pin directory", e))?;
    if (by_path.dev(), by_path.ino()) != (held.dev(), held.ino()) {
        return Err(io_err(
            "using pin directory",
            std::io::Error::other("its path names another directory than the one verified"),
        ));
    }
    Ok((fresh, file))
}

/// The directory to start the walk to `dir` from (opened), its path, and the names below it:
/// the bpffs mount that holds `dir` (root's), or else `dir`'s parent (created if missing).
fn walk_start(dir: &Path) -> std::io::Result<(fs::File, PathBuf, Vec<std::ffi::OsString>)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::path::Component;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (start, rest) = match bpffs_of(&mountinfo, dir) {
        Some((mnt, _)) => (PathBuf::from(mnt), dir.strip_prefix(mnt).unwrap_or(dir)),
        None => {
            let parent = dir.parent().unwrap_or(Path::new("/"));
            fs::create_dir_all(parent)?;
            (
                parent.to_path_buf(),
                Path::new(dir.file_name().unwrap_or_default()),
            )
        }
    };
    let mut names = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(name) => names.push(name.to_owned()),
            Component::CurDir => {}
            _ => {
                return Err(std::io::Error::other(format!(
                    "{} is not a plain path below {}",
                    dir.display(),
                    start.display()
                )))
            }
        }
    }
    let file = fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&start)?;
    Ok((file, start, names))
}

fn c_name(name: &std::ffi::OsStr) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt as _;
    std::ffi::CString::new(name.as_bytes()).map_err(std::io::Error::other)
}

fn last_os_error_unless(ret: libc::c_int) -> std::io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `fstatat(parent, name, AT_SYMLINK_NOFOLLOW)`.
fn stat_at(parent: &fs::File, name: &std::ffi::CStr) -> std::io::Result<libc::stat> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: all-zero is a valid `stat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor we own, a NUL-terminated name and a `stat` to write.
    last_os_error_unless(unsafe {
        libc::fstatat(
            parent.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

fn mkdir_at(parent: &fs::File, name: &std::ffi::CStr) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a descriptor we own and a NUL-terminated name.
    last_os_error_unless(unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o700) })
}

fn rename_at(
    parent: &fs::File,
    from: &std::ffi::CStr,
    to: &std::ffi::CStr,
    flags: libc::c_uint,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let fd = parent.as_raw_fd();
    // SAFETY: a descriptor we own and NUL-terminated names.
    last_os_error_unless(unsafe { libc::renameat2(fd, from.as_ptr(), fd, to.as_ptr(), flags) })
}

/// What a file's type is called in a log.
fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFREG => "file",
        _ => "special file",
    }
}

/// Makes `name` in `parent` (whose path is `path`) a directory of user `euid`, opened without
/// following a symlink; `last`: the pin directory itself (mode 0700, locked, holding nothing but
/// files of `euid`), else a directory on the way to it (not writable by others). What is there
/// otherwise is moved aside (see [`quarantine`]). Returns whether the directory is new.
fn own_dir(
    parent: &fs::File,
    name: &std::ffi::OsStr,
    path: &Path,
    euid: u32,
    last: bool,
) -> Result<(bool, fs::File)> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let io_err = |what, source| DataplaneError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    let cname = c_name(name).map_err(|e| io_err("using pin directory", e))?;
    let mut fresh = false;
    for _ in 0..PIN_DIR_TRIES {
        let st = match stat_at(parent, &cname) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                match mkdir_at(parent, &cname) {
                    Ok(()) => fresh = true,
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => return Err(io_err("creating pin directory", e)),
                }
                continue;
            }
            Err(e) => return Err(io_err("inspecting pin directory", e)),
            Ok(st) => st,
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR || st.st_uid != euid {
            let found = format!(
                "a {} of uid {} (mode {:o})",
                kind_of(st.st_mode),
                st.st_uid,
                st.st_mode & 0o7777
            );
            quarantine(parent, &cname, path, &found)?;
            fresh = true;
            continue;
        }
        // SAFETY: a descriptor we own and a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                parent.as_raw_fd(),
                cname.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            // Replaced since it was looked at: look again.
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR)
            ) {
                continue;
            }
            return Err(io_err("opening pin directory", e));
        }
        // SAFETY: a descriptor just opened, owned by nothing else.
        let file = unsafe { fs::File::from_raw_fd(fd) };
        // SAFETY: all-zero is a valid `stat`.
        let mut now: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor we own and a `stat` to write.
        last_os_error_unless(unsafe { libc::fstat(fd, &mut now) })
            .map_err(|e| io_err("inspecting pin directory", e))?;
        if (now.st_dev, now.st_ino, now.st_uid) != (st.st_dev, st.st_ino, euid) {
            continue;
        }
        let mode = now.st_mode & 0o7777;
        if !last {
            // Others could otherwise swap the pin directory below it for one of theirs.
            if mode & 0o022 != 0 && mode & libc::S_ISVTX == 0 {
                // SAFETY: a descriptor we own.
                last_os_error_unless(unsafe { libc::fchmod(fd, mode & !0o022) })
                    .map_err(|e| io_err("removing others' write access to", e))?;
            }
            return Ok((fresh, file));
        }
        let loose = mode != 0o700;
        if loose {
            // SAFETY: a descriptor we own.
            last_os_error_unless(unsafe { libc::fchmod(fd, 0o700) })
                .map_err(|e| io_err("setting mode 0700 on pin directory", e))?;
        }
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io_err("locking pin directory", e));
            }
            // No agent runs in a directory others could open, nor as another user: whoever
            // holds the lock then is not one (another user may have opened the directory while
            // its mode let them, and kept it open).
            let holder = foreign_lock_holder(&now, euid);
            if !loose && holder.is_none() {
                return Err(DataplaneError::PinDirBusy(path.to_path_buf()));
            }
            drop(file);
            let found = format!(
                "a directory of mode {mode:o} locked by {}",
                holder.as_deref().unwrap_or("another process")
            );
            quarantine(parent, &cname, path, &found)?;
            fresh = true;
            continue;
        }
        if let Some(found) = foreign_entry(path, euid) {
            drop(file);
            quarantine(
                parent,
                &cname,
                path,
                &format!("a directory holding {found}"),
            )?;
            fresh = true;
            continue;
        }
        return Ok((fresh, file));
    }
    Err(io_err(
        "creating pin directory",
        std::io::Error::other(format!(
            "something else kept taking its place ({PIN_DIR_TRIES} tries)"
        )),
    ))
}

/// Who holds the `flock` on the directory `st` describes, when that is a process whose
/// effective user is not `euid` (from /proc/locks and the holder's /proc/PID/status): `None`
/// when it runs as `euid` or cannot be told.
fn foreign_lock_holder(st: &libc::stat, euid: u32) -> Option<String> {
    let locks = fs::read_to_string("/proc/locks").ok()?;
    let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
    let file = format!("{major:02x}:{minor:02x}:{}", st.st_ino);
    for line in locks.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" marks a waiter).
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") || f.get(5) != Some(&file.as_str()) {
            continue;
        }
        let Some(pid) = f.get(4).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|u| u.parse::<u32>().ok())?;
        return (uid != euid).then(|| format!("process {pid} of uid {uid}"));
    }
    None
}

/// The first entry of the (verified, locked) directory `dir` that none of this user's pins could
/// be: an entry of another user, or anything but a file (a pin is one; users without CAP_BPF can
/// create directories and symlinks on a bpffs, never pins).
fn foreign_entry(dir: &Path, euid: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => return Some(format!("entries that cannot be listed ({e})")),
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => return Some(format!("entries that cannot be listed ({e})")),
        };
        let meta = match fs::symlink_metadata(entry.path()) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Some(format!(
                    "{:?}, which cannot be inspected ({e})",
                    entry.file_name()
                ))
            }
        };
        if meta.uid() != euid || !meta.file_type().is_file() {
            return Some(format!(
                "{:?}, a {} of uid {}",
                entry.file_name(),
                kind_of(meta.mode()),
                meta.uid()
            ));
        }
    }
    None
}

/// Moves what is at `name` in `parent` (whose path is `path`) aside to a fresh
/// `NAME_quarantine_PID_RANDOM` in the same parent (bpffs refuses names with a dot), putting a
/// new empty directory of this user (mode 0700) in its place in the same rename
/// (`RENAME_EXCHANGE`): the name is never free for someone else to take. Root may rename other users' entries in a sticky directory it owns (a
/// bpffs root), and a directory within its parent without write access to it.
fn quarantine(parent: &fs::File, name: &std::ffi::CStr, path: &Path, found: &str) -> Result<()> {
    let io_err = |what, source| DataplaneError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    let base = path.file_name().unwrap_or_default().to_string_lossy();
    for _ in 0..PIN_DIR_TRIES {
        let mut random = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `random`.
        let n = unsafe { libc::getrandom(random.as_mut_ptr().cast(), random.len(), 0) };
        if n != 8 {
            return Err(io_err(
                "moving aside what was found at",
                std::io::Error::last_os_error(),
            ));
        }
        let aside_name = format!(
            "{base}_quarantine_{}_{:016x}",
            std::process::id(),
            u64::from_le_bytes(random)
        );
        let aside = c_name(aside_name.as_ref()).map_err(|e| io_err("using pin directory", e))?;
        match mkdir_at(parent, &aside) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(io_err("creating a directory to replace", e)),
        }
        let moved_to = path.with_file_name(&aside_name);
        let removed_aside = || {
            use std::os::fd::AsRawFd as _;
            // SAFETY: a descriptor we own and a NUL-terminated name.
            unsafe { libc::unlinkat(parent.as_raw_fd(), aside.as_ptr(), libc::AT_REMOVEDIR) };
        };
        for _ in 0..PIN_DIR_TRIES {
            match rename_at(parent, &aside, name, libc::RENAME_EXCHANGE) {
                Ok(()) => {
                    tracing::warn!(
                        pin_dir = %path.display(),
                        found = %found,
                        moved_to = %moved_to.display(),
                        "the pin directory's path held something this agent neither uses nor \
                         trusts (planted by another user?): moved it aside"
                    );
                    return Ok(());
                }
                // Gone in the meantime: put the fresh directory there, unless someone was faster.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => {
                    removed_aside();
                    return Err(io_err("moving aside what was found at", e));
                }
            }
            match rename_at(parent, &aside, name, libc::RENAME_NOREPLACE) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    removed_aside();
                    return Err(io_err("creating pin directory", e));
                }
            }
        }
        // The caller looks again.
        removed_aside();
        return Ok(());
    }
    Err(io_err(
        "moving aside what was found at",
        std::io::Error::other("no free quarantine name"),
    ))
}

/// The index of interface `name` in this process's network namespace, 0 if there is none.
#[must_use]
pub fn ifindex(name: &str) -> u32 {
    if name.is_empty() || name.len() > 15 {
        return 0;
    }
    let Ok(c) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: a valid NUL-terminated string; if_nametoindex has no other precondition.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

/// Whether generic receive offload is on for `iface` (`ETHTOOL_GGRO`), or `None` where the
/// kernel does not say. In skb (generic) mode the XDP program runs after GRO, on what it merged.
#[must_use]
pub fn gro_enabled(iface: &str) -> Option<bool> {
    /// `ETHTOOL_GGRO` of linux/ethtool.h.
    const ETHTOOL_GGRO: u32 = 0x2b;
    ethtool_value(iface, ETHTOOL_GGRO, 0).ok().map(|v| v != 0)
}

/// One `struct ethtool_value` command (`cmd`, e.g. `ETHTOOL_GGRO` or `ETHTOOL_SGRO` of
/// linux/ethtool.h, with `data`) on `iface` of this thread's network namespace, through
/// `SIOCETHTOOL`: the `data` the kernel gives back.
///
/// # Errors
/// A name that cannot be an interface's, or the socket's or the ioctl's error.
pub fn ethtool_value(iface: &str, cmd: u32, data: u32) -> std::io::Result<u32> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    /// `struct ethtool_value` of linux/ethtool.h.
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let name = iface.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let mut value = EthtoolValue { cmd, data };
    // SAFETY: an all-zero ifreq is valid (a zero name, a null union).
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&raw mut value).cast();
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCETHTOOL reads the NUL-terminated name and reads and writes `value`, which
    // outlives the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCETHTOOL, &raw mut ifr) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value.data)
}

/// Whether `name` is an interface of this process's network namespace. (Not a look at
/// /sys/class/net: that shows the namespace of whoever mounted sysfs, which differs under
/// `nsenter --net` or in a container that was given the host's /sys.)
#[must_use]
pub fn interface_exists(name: &str) -> bool {
    ifindex(name) != 0
}

fn remove_link_pin(pin: &Path) -> Result<()> {
    match fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DataplaneError::Io {
            what: "removing pinned link",
            path: pin.to_path_buf(),
            source,
        }),
    }
}

/// Removes every pinned link in `dir` (links of interfaces this agent did not attach to, left by
/// an earlier agent): with no other reference, each link is released and its program detached.
pub fn remove_link_pins(dir: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with("link_") {
            remove_link_pin(&entry.path())?;
        }
    }
    Ok(())
}

/// Checks that `dir` is a directory of this user (for `ratelimit detach --pin-path`, before
/// [`remove_pin_dir`]), not a symlink (which `detach` would follow,
/// removing files named like pins wherever another user pointed it) nor another user's
/// directory (an agent's pin directory is its own: see `prepare_pin_dir`).
pub fn check_own_pin_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let refuse = |why: String| DataplaneError::Io {
        what: "using pin directory",
        path: dir.to_path_buf(),
        source: std::io::Error::other(why),
    };
    let meta = fs::symlink_metadata(dir).map_err(|source| DataplaneError::Io {
        what: "inspecting pin directory",
        path: dir.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.file_type().is_symlink() {
        return Err(refuse(
            "it is a symlink, not followed (anyone may plant one on a bpffs of mode 1777): name \
             the pin directory itself"
                .into(),
        ));
    }
    if !meta.is_dir() {
        return Err(refuse("it is not a directory".into()));
    }
    if meta.uid() != euid {
        return Err(refuse(format!(
            "it belongs to uid {}, not to this user (uid {euid}): not an agent's pin directory",
            meta.uid()
        )));
    }
    Ok(())
}

/// Detaches and removes everything a (possibly dead) agent left in `pin_dir`: pinned links (so
/// the interfaces stop running the program) and pinned maps. For `ratelimit detach` without a
/// running agent.
pub fn remove_pin_dir(pin_dir: &Path) -> Result<()> {
    remove_link_pins(pin_dir)?;
    maps::remove_pins(pin_dir).map_err(|source| DataplaneError::Io {
        what: "removing pinned maps in",
        path: pin_dir.to_path_buf(),
        source,
    })
}

fn xdp_program(ebpf: &mut Ebpf) -> Result<&mut Xdp> {
    ebpf.program_mut(PROGRAM_NAME)
        .ok_or_else(|| DataplaneError::Load(format!("no program {PROGRAM_NAME} in the object")))?
        .try_into()
        .map_err(|e| DataplaneError::Load(format!("{e}")))
}

/// The OS error number somewhere in the error's source chain.
fn os_error(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(code) = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
        {
            return Some(code);
        }
        next = err.source();
    }
    None
}

/// The error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// Program load errors carry the verifier log; keep its tail, which says what was rejected.
fn verifier_error(e: &aya::programs::ProgramError) -> String {
    let full = format!("{e:#}");
    let lines: Vec<&str> = full.lines().collect();
    if lines.len() <= 40 {
        return full;
    }
    format!(
        "{}\n...\n{}",
        lines[0],
        lines[lines.len() - 30..].join("\n")
    )
}

/// Makes sure bpffs is mounted at /sys/fs/bpf when the pin directory lives below it.
fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !pin_dir.starts_with(root) || is_bpffs(root) {
        return Ok(());
    }
    // Under `ip netns exec` (a private mount namespace with a fresh /sys) the bpffs mounted here
    // is private to this process tree: `warn_if_private_bpffs`, run next, says so.
    // Mode 0700: only root may create pins or directories in it (the kernel's default, 1777,
    // lets any user plant a directory where an agent will put its pins).
    let status = std::process::Command::new("mount")
        .args(["-t", "bpf", "-o", "mode=0700", "bpf"])
        .arg(root)
        .status()
        .map_err(|source| DataplaneError::Bpffs {
            path: root.into(),
            source,
        })?;
    if !status.success() || !is_bpffs(root) {
        return Err(DataplaneError::Bpffs {
            path: root.into(),
            source: std::io::Error::other(format!("mount -t bpf exited with {status}")),
        });
    }
    tracing::info!(path = %root.display(), "mounted bpffs");
    Ok(())
}

/// Warns when the bpffs that holds `pin_dir` is not the one PID 1 sees (a bpffs mounted in a
/// private mount namespace: `ip netns exec`, a container without the host's /sys/fs/bpf): the
/// pins end with that namespace, so enforcement does not outlive the agent as docs/design.md
/// says ("Containers and network namespaces").
fn warn_if_private_bpffs(pin_dir: &Path) {
    let (Ok(ours), Ok(init)) = (
        fs::read_to_string("/proc/self/mountinfo"),
        fs::read_to_string("/proc/1/mountinfo"),
    ) else {
        return;
    };
    let Some((mount_point, dev)) = bpffs_of(&ours, pin_dir) else {
        return;
    };
    let shared = bpffs_devices(&init).any(|(_, d)| d == dev);
    if !shared {
        tracing::warn!(
            bpffs = %mount_point,
            "the bpffs holding the pins is private to this agent's mount namespace (PID 1 does not \
             see it): the pins, and enforcement after the agent exits or crashes, end with this \
             namespace. Run the agent in the host's mount namespace (`nsenter --net=/run/netns/NAME \
             ratelimit agent ...` rather than `ip netns exec`), or bind-mount the host's \
             /sys/fs/bpf into the container"
        );
    }
}

/// (mount point, device) of every bpffs in a `/proc/PID/mountinfo` text.
fn bpffs_devices(mountinfo: &str) -> impl Iterator<Item = (&str, &str)> {
    mountinfo.lines().filter_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let sep = f.iter().position(|x| *x == "-")?;
        if f.get(sep + 1) != Some(&"bpf") {
            return None;
        }
        Some((*f.get(4)?, *f.get(2)?))
    })
}

/// The bpffs mount (mount point, device) that `path` lives on: the longest mount point that
/// contains it.
fn bpffs_of<'a>(mountinfo: &'a str, path: &Path) -> Option<(&'a str, &'a str)> {
    bpffs_devices(mountinfo)
        .filter(|(mnt, _)| path.starts_with(mnt))
        .max_by_key(|(mnt, _)| mnt.len())
}

fn is_bpffs(path: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|m| bpffs_devices(&m).any(|(mnt, _)| Path::new(mnt) == path))
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

    const MOUNTINFO: &str = "\
22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
30 22 0:26 / /sys/fs/bpf rw,nosuid shared:12 - bpf bpf rw,mode=700
31 30 0:40 / /sys/fs/bpf/inner rw - bpf bpf rw
40 1 0:50 / /mnt/other rw - tmpfs tmpfs rw
";

    fn key(i: u8) -> MirrorKey {
        MirrorKey {
            family: 4,
            addr: [10, i, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            prefix_len: 32,
        }
    }

    fn rules(ids: &[u32]) -> RuleSet {
        let mut set = RuleSet {
            len: u32::try_from(ids.len()).unwrap(),
            ..RuleSet::default()
        };
        set.rules[..ids.len()].copy_from_slice(ids);
        set
    }

    #[test]
    fn a_prefix_diff_holds_what_changed_and_nothing_else() {
        // Deterministic draws: each of 40 keys absent, or present with one of 3 rule sets, in
        // an old and a new set.
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut draw = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 4
        };
        for _ in 0..200 {
            let mut old = Vec::new();
            let mut new = Vec::new();
            for i in 0..40 {
                for list in [&mut old, &mut new] {
                    match draw() {
                        0 => {}
                        v => list.push((key(i), rules(&[u32::try_from(v).unwrap()]))),
                    }
                }
            }
            let diff = PrefixDiff::between(&old, &new);
            let old_map: std::collections::BTreeMap<_, _> = old.iter().copied().collect();
            let new_map: std::collections::BTreeMap<_, _> = new.iter().copied().collect();
            let gone: Vec<_> = old_map
                .keys()
                .filter(|k| !new_map.contains_key(*k))
                .copied()
                .collect();
            let set: Vec<_> = new
                .iter()
                .filter(|(k, r)| old_map.get(k) != Some(r))
                .copied()
                .collect();
            assert_eq!(diff, PrefixDiff { gone, set });
            // Applied to the old set, it gives the new one.
            let mut applied = old_map.clone();
            for k in &diff.gone {
                applied.remove(k);
            }
            applied.extend(diff.set.iter().copied());
            assert_eq!(applied, new_map);
        }
        assert_eq!(
            PrefixDiff::between(&[(key(1), rules(&[1]))], &[(key(1), rules(&[1]))]),
            PrefixDiff::default()
        );
    }

    #[test]
    fn the_mirror_is_sorted_and_a_repeated_prefix_holds_its_last_rules() {
        use crate::config::RuleConfig;
        let config: Vec<RuleConfig> =
            ["10.2.0.0/16", "10.1.0.0/16", "2001:db8::/32", "10.1.0.0/24"]
                .iter()
                .enumerate()
                .map(|(i, net)| RuleConfig {
                    rate: Some(100),
                    burst: Some(100),
                    ..RuleConfig::new(format!("r{i}"), net.parse().unwrap())
                })
                .collect();
        let mut set = crate::compile::compile(&config, &crate::compile::RuleIds::new()).unwrap();
        let sorted = mirror_of(&set);
        assert_eq!(sorted.len(), 4);
        assert!(sorted.windows(2).all(|w| w[0].0 < w[1].0));
        // Handed over out of order and with a prefix twice: the same, the later entry's rules.
        set.prefixes.reverse();
        let mut again = set.prefixes[0].clone();
        again.rules = rules(&[7]);
        set.prefixes.push(again.clone());
        let mirror = mirror_of(&set);
        assert_eq!(mirror.len(), 4);
        assert!(mirror.windows(2).all(|w| w[0].0 < w[1].0));
        let held = mirror
            .iter()
            .find(|(k, _)| k.addr == again.addr && k.prefix_len == again.lpm_prefix_len())
            .unwrap();
        assert_eq!(held.1, rules(&[7]));
    }

    #[test]
    fn an_id_set_holds_exactly_its_ids() {
        let ids = IdSet::from_ids([0, 63, 64, 700, MAX_RULES - 1]);
        assert_eq!(
            ids.iter().collect::<Vec<_>>(),
            [0, 63, 64, 700, MAX_RULES - 1]
        );
        assert!(!ids.contains(1) && !ids.contains(MAX_RULES) && !ids.contains(u32::MAX));
        assert_eq!(IdSet::from_ids([]).iter().count(), 0);
    }

    #[test]
    fn the_pins_bpffs_is_the_longest_bpf_mount_that_holds_them() {
        let all: Vec<_> = bpffs_devices(MOUNTINFO).collect();
        assert_eq!(
            all,
            [("/sys/fs/bpf", "0:26"), ("/sys/fs/bpf/inner", "0:40")]
        );
        let of = |p: &str| bpffs_of(MOUNTINFO, Path::new(p));
        assert_eq!(of("/sys/fs/bpf/ratelimit"), Some(("/sys/fs/bpf", "0:26")));
        assert_eq!(
            of("/sys/fs/bpf/inner/rl"),
            Some(("/sys/fs/bpf/inner", "0:40"))
        );
        assert_eq!(of("/mnt/other/rl"), None);
        // A path that only shares a prefix of characters is not under the mount.
        assert_eq!(of("/sys/fs/bpfx/rl"), None);
    }
}
