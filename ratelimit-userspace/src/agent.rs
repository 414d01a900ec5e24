//! The agent: validates the config, loads the XDP program, installs the rules, attaches to the
//! interfaces, serves the control API, reloads on change, and on shutdown detaches cleanly (or,
//! with `--keep-attached`, leaves the limiter enforcing for the next agent to adopt).
//!
//! Everything that can be refused (config syntax, rule semantics, unknown interfaces) is checked
//! before anything on the host changes: at start, before the program is loaded; on a reload or an
//! API change, before the new rule set is swapped in. A refused change leaves the rules in force.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use aya_log::EbpfLogger;
use ratelimit_common::{config_flags, family, global, Bucket, BucketKey};
use serde::Serialize;
use tokio::{io::unix::AsyncFd, sync::Mutex};

use crate::{
    compile::{compile, CompileError, CompiledRuleSet, RuleIds},
    config::{AttachMode, Config, ConfigError, RuleConfig},
    dataplane::{Dataplane, DataplaneError, LinkHealth, LoadOptions},
    maps::MapsError,
    stats::StatsReport,
};

/// Errors of the agent: at start they stop it; for a change they refuse the change.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The config file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The rules do not compile.
    #[error("{origin}: {source}")]
    Compile {
        /// Where the rules came from (config file, API request).
        origin: String,
        /// What is wrong.
        source: CompileError,
    },
    /// No interface to attach to.
    #[error(
        "no interfaces to attach to: set `interfaces` in the [agent] table of {0} or pass --iface"
    )]
    NoInterfaces(PathBuf),
    /// An interface named in the config or on the command line does not exist.
    #[error("interface {name:?} (from {origin}) does not exist")]
    NoSuchInterface {
        /// Interface name.
        name: String,
        /// Where it was named.
        origin: String,
    },
    /// A request named a rule that does not exist.
    #[error("no rule named {0:?}")]
    NoSuchRule(String),
    /// A request would add a rule whose name is taken.
    #[error("a rule named {0:?} already exists")]
    RuleExists(String),
    /// A request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// Loading, attaching or updating the data plane failed.
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    /// Reading the pinned maps failed.
    #[error(transparent)]
    Maps(#[from] MapsError),
    /// Setting up signal handling, a socket or the log reader failed.
    #[error("{0}")]
    Runtime(String),
}

/// What the agent is asked to do (the config file plus command-line overrides).
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Config file.
    pub config_path: PathBuf,
    /// Interfaces from the command line; replace the config's when not empty.
    pub interfaces: Vec<String>,
    /// Attach mode from the command line; overrides the config's.
    pub mode: Option<AttachMode>,
    /// On exit, leave the program attached and the maps pinned (for an upgrade or restart).
    pub keep_attached: bool,
}

/// Loads and validates the config with the command-line overrides applied; nothing on the host is
/// touched. Returns the config with the final interface list.
pub fn prepare(opts: &AgentOptions) -> Result<Config, AgentError> {
    let mut config = Config::load(&opts.config_path)?;
    let origin = if opts.interfaces.is_empty() {
        format!("[agent] interfaces in {}", opts.config_path.display())
    } else {
        config.agent.interfaces.clone_from(&opts.interfaces);
        "--iface".to_string()
    };
    if let Some(mode) = opts.mode {
        config.agent.mode = mode;
    }
    if config.agent.interfaces.is_empty() {
        return Err(AgentError::NoInterfaces(opts.config_path.clone()));
    }
    check_interfaces(&config.agent.interfaces, &origin)?;
    if let Some(cluster) = &config.cluster {
        crate::cluster::check(cluster)?;
    }
    // Compile once against empty ids: proves the rule set is valid before anything is loaded.
    compile(&config.rules, &RuleIds::new()).map_err(|source| AgentError::Compile {
        origin: opts.config_path.display().to_string(),
        source,
    })?;
    Ok(config)
}

fn check_interfaces(names: &[String], origin: &str) -> Result<(), AgentError> {
    for name in names {
        if !crate::dataplane::interface_exists(name) {
            return Err(AgentError::NoSuchInterface {
                name: name.clone(),
                origin: origin.to_string(),
            });
        }
    }
    Ok(())
}

/// Reload bookkeeping shown by `status` and the metrics.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReloadState {
    /// Rule-set changes applied (file reloads, SIGHUP, API).
    pub ok: u64,
    /// Rule-set changes refused.
    pub failed: u64,
    /// Why the last refused change was refused, if the last change failed.
    pub last_error: Option<String>,
    /// When the rules in force were installed (seconds since the Unix epoch).
    pub last_ok_unix: u64,
    /// Settings changed in the file that only take effect on restart.
    pub restart_needed: Vec<String>,
}

/// The running agent's state. Shared between the API, the watcher and the signal handler behind
/// one mutex: every change is applied whole while holding it.
pub struct Agent {
    opts: AgentOptions,
    config: Config,
    ids: RuleIds,
    set: CompiledRuleSet,
    dp: Dataplane,
    reload: ReloadState,
    started: Instant,
    /// The cluster sync, when `[cluster]` is set and it runs.
    cluster: Option<crate::cluster::ClusterHandle>,
    /// Configured interfaces that are gone (deleted, or failing to attach again after they came
    /// back); see [`Agent::recheck_interfaces`].
    missing: BTreeSet<String>,
}

/// The agent as the API and tasks share it.
pub type SharedAgent = Arc<Mutex<Agent>>;

impl Agent {
    /// Validates the config, loads the program (adopting pinned state), installs the rules and
    /// attaches. On failure nothing is left attached or pinned that was not there before.
    pub fn start(opts: AgentOptions) -> Result<Self, AgentError> {
        let config = prepare(&opts)?;
        let dp = Dataplane::load(&LoadOptions {
            pin_dir: config.agent.pin_path.clone(),
            max_buckets: config.agent.max_buckets,
        })?;
        // Ids of rules already installed (a previous agent's pinned state) are kept, so unchanged
        // rules keep their buckets across a restart.
        let installed = dp.maps().named_rules()?;
        let adopted = !installed.is_empty();
        let ids = RuleIds::from_installed(installed_ids(installed)).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "pinned rule ids unusable; assigning new ones");
            RuleIds::new()
        });
        let set = compile(&[], &ids).map_err(|source| AgentError::Compile {
            origin: "empty rule set".into(),
            source,
        })?;
        let mut agent = Self {
            opts,
            config: config.clone(),
            ids,
            set,
            dp,
            reload: ReloadState::default(),
            started: Instant::now(),
            cluster: None,
            missing: BTreeSet::new(),
        };
        if let Err(e) = agent.bring_up(&config, adopted) {
            if let Err(cleanup) = agent.dp.remove() {
                tracing::warn!(error = %cleanup, "cleaning up after a failed start");
            }
            return Err(e);
        }
        Ok(agent)
    }

    fn bring_up(&mut self, config: &Config, adopted: bool) -> Result<(), AgentError> {
        let origin = self.opts.config_path.display().to_string();
        self.install_rules(&config.rules, &origin)?;
        self.dp.set_flags(flags_of(config))?;
        tracing::info!(
            rules = self.set.rules.len(),
            prefixes = self.set.prefixes.len(),
            dry_run = config.agent.dry_run,
            adopted,
            pin_dir = %config.agent.pin_path.display(),
            "rules installed"
        );
        for iface in &config.agent.interfaces {
            let att = self.dp.attach(iface, config.agent.mode)?;
            tracing::info!(iface = %att.iface, mode = att.mode, "attached");
        }
        Ok(())
    }

    /// Compiles `rules` against the installed ids and swaps them in whole; on any error the
    /// rules in force stay.
    fn install_rules(&mut self, rules: &[RuleConfig], origin: &str) -> Result<(), AgentError> {
        let set = compile(rules, &self.ids).map_err(|source| AgentError::Compile {
            origin: origin.to_string(),
            source,
        })?;
        self.dp.install(&set)?;
        self.ids
            .commit(&set)
            .map_err(|source| AgentError::Compile {
                origin: origin.to_string(),
                source,
            })?;
        self.set = set;
        self.config.rules = rules.to_vec();
        Ok(())
    }

    /// Replaces the rule set (from the API): validated whole, swapped in atomically, then written
    /// back to the config file. Counts as a reload.
    pub fn replace_rules(
        &mut self,
        rules: Vec<RuleConfig>,
        origin: &str,
    ) -> Result<(), AgentError> {
        let previous = self.config.rules.clone();
        let mut result = self.install_rules(&rules, origin);
        if result.is_ok() {
            if let Err(e) = write_back(&self.opts.config_path, &rules) {
                // A change the file cannot record would be lost on the next reload: undo it, so
                // that a refused change leaves the rules in force as they were.
                if let Err(undo) = self.install_rules(&previous, "restoring the rules in force") {
                    tracing::error!(error = %undo, "restoring the rules after a failed write-back");
                }
                result = Err(e);
            }
        }
        self.count_reload(&result);
        result
    }

    /// Adds one rule (from the API).
    pub fn add_rule(&mut self, rule: RuleConfig) -> Result<(), AgentError> {
        if self.config.rules.iter().any(|r| r.name == rule.name) {
            return Err(AgentError::RuleExists(rule.name));
        }
        let mut rules = self.config.rules.clone();
        let name = rule.name.clone();
        rules.push(rule);
        self.replace_rules(rules, &format!("rules add {name:?}"))
    }

    /// Removes one rule by name (from the API).
    pub fn remove_rule(&mut self, name: &str) -> Result<(), AgentError> {
        let mut rules = self.config.rules.clone();
        let before = rules.len();
        rules.retain(|r| r.name != name);
        if rules.len() == before {
            return Err(AgentError::NoSuchRule(name.to_string()));
        }
        self.replace_rules(rules, &format!("rules remove {name:?}"))
    }

    /// Re-reads the config file and applies it: rules swapped in whole, `dry_run` and `ebpf_log`
    /// applied live, interfaces added or removed. Settings that need a restart are reported.
    pub fn reload(&mut self) -> Result<(), AgentError> {
        let result = self.reload_inner();
        self.count_reload(&result);
        if let Err(e) = &result {
            tracing::error!(error = %e, "reload refused; the rules in force stay");
        }
        result
    }

    fn reload_inner(&mut self) -> Result<(), AgentError> {
        let mut new = Config::load(&self.opts.config_path)?;
        if !self.opts.interfaces.is_empty() {
            new.agent.interfaces.clone_from(&self.opts.interfaces);
        }
        if let Some(mode) = self.opts.mode {
            new.agent.mode = mode;
        }
        // Refused at start, so refused here too: otherwise a file emptied by accident (a config
        // manager truncating it, a botched edit) would detach every interface and drop the rules.
        // `ratelimit detach` is the way to stop enforcing on purpose.
        if new.agent.interfaces.is_empty() {
            return Err(AgentError::NoInterfaces(self.opts.config_path.clone()));
        }
        let origin = self.opts.config_path.display().to_string();
        let old_ifaces = self.config.agent.interfaces.clone();
        // Only interfaces new to the config must exist: one already configured may be missing
        // for now (deleted; attached again when it returns), which must not block rule changes.
        let added: Vec<String> = new
            .agent
            .interfaces
            .iter()
            .filter(|i| !old_ifaces.contains(i))
            .cloned()
            .collect();
        check_interfaces(&added, &format!("[agent] interfaces in {origin}"))?;
        // Everything validated: from here on each step is applied.
        self.install_rules(&new.rules, &origin)?;
        self.dp.set_flags(flags_of(&new))?;
        for iface in &added {
            let att = self.dp.attach(iface, new.agent.mode)?;
            tracing::info!(iface = %att.iface, mode = att.mode, "attached (reload)");
        }
        for iface in old_ifaces
            .iter()
            .filter(|i| !new.agent.interfaces.contains(i))
        {
            self.dp.detach(iface)?;
            self.missing.remove(iface);
            tracing::info!(iface = %iface, "detached (reload)");
        }
        let mut restart = Vec::new();
        let (a, b) = (&self.config.agent, &new.agent);
        if a.mode != b.mode {
            restart.push("mode".to_string());
        }
        if a.socket != b.socket {
            restart.push("socket".to_string());
        }
        if a.metrics != b.metrics {
            restart.push("metrics".to_string());
        }
        if a.max_buckets != b.max_buckets {
            restart.push("max_buckets".to_string());
        }
        if a.pin_path != b.pin_path {
            restart.push("pin_path".to_string());
        }
        if self.config.cluster != new.cluster {
            restart.push("cluster".to_string());
        }
        // Keep the settings in force for what needs a restart, take the rest.
        let mut agent = new.agent.clone();
        agent.mode = a.mode;
        agent.socket.clone_from(&a.socket);
        agent.metrics = a.metrics;
        agent.max_buckets = a.max_buckets;
        agent.pin_path.clone_from(&a.pin_path);
        self.config.agent = agent;
        self.reload.restart_needed = restart;
        tracing::info!(rules = self.set.rules.len(), "reloaded");
        Ok(())
    }

    fn count_reload<T>(&mut self, result: &Result<T, AgentError>) {
        match result {
            Ok(_) => {
                self.reload.ok += 1;
                self.reload.last_error = None;
                self.reload.last_ok_unix = unix_now();
            }
            Err(e) => {
                self.reload.failed += 1;
                self.reload.last_error = Some(e.to_string());
            }
        }
    }

    /// Notices configured interfaces that were deleted (the kernel detaches XDP with them; the
    /// agent keeps running and `status` shows them as missing) and attaches again to those that
    /// were created anew. Run every second by the agent; logs only changes.
    pub fn recheck_interfaces(&mut self) {
        let mode = self.config.agent.mode;
        for iface in self.config.agent.interfaces.clone() {
            let health = self.dp.link_health(&iface);
            // Attach again when an interface of that name is there but the program is not on it.
            let reattach = match health {
                // Gone and back with the same index between two checks.
                Some(LinkHealth::Attached) => self.missing.contains(&iface),
                Some(LinkHealth::Replaced) => true,
                Some(LinkHealth::Missing) => false,
                // Not attached any more: an earlier attempt to attach again failed.
                None => crate::dataplane::interface_exists(&iface),
            };
            if reattach {
                match self.dp.reattach(&iface, mode) {
                    Ok(att) => {
                        tracing::info!(iface = %att.iface, mode = att.mode, "attached again: the interface was created anew");
                        self.missing.remove(&iface);
                    }
                    // Logged on the first failure only (`health` is `None` on the retries).
                    Err(e) => {
                        self.missing.insert(iface.clone());
                        if health.is_some() {
                            tracing::error!(iface = %iface, error = %e, "the interface is back but attaching to it failed; retrying every second");
                        }
                    }
                }
            } else if health != Some(LinkHealth::Attached) && self.missing.insert(iface.clone()) {
                tracing::warn!(
                    iface = %iface,
                    "interface deleted: the program was detached with it; it is attached again when \
                     an interface of that name appears"
                );
            }
        }
    }

    /// The list files (`source_file`) the rules in force were read from.
    #[must_use]
    pub fn list_files(&self) -> Vec<PathBuf> {
        self.config
            .rules
            .iter()
            .filter_map(|r| r.source_file.clone())
            .collect()
    }

    /// The config in force.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The compiled rule set in force.
    #[must_use]
    pub fn rule_set(&self) -> &CompiledRuleSet {
        &self.set
    }

    /// The data plane.
    #[must_use]
    pub fn dataplane(&self) -> &Dataplane {
        &self.dp
    }

    /// Reload bookkeeping.
    #[must_use]
    pub fn reload_state(&self) -> &ReloadState {
        &self.reload
    }

    /// The cluster's members and counters (`None` without `[cluster]`).
    #[must_use]
    pub fn cluster_status(&self) -> Option<crate::cluster::ClusterStatus> {
        self.cluster
            .as_ref()
            .map(crate::cluster::ClusterHandle::status)
    }

    /// What `ratelimit status` shows.
    pub fn status(&self) -> Result<Status, AgentError> {
        let maps = self.dp.maps();
        let generation = maps.config()?.generation;
        Ok(Status {
            version: env!("CARGO_PKG_VERSION"),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            config: self.opts.config_path.display().to_string(),
            pin_path: self.config.agent.pin_path.display().to_string(),
            socket: self.config.agent.socket.display().to_string(),
            interfaces: self.interface_status(),
            rules: self.set.rules.len(),
            prefixes: self.set.prefixes.len(),
            generation,
            dry_run: self.config.agent.dry_run,
            buckets_tracked: maps.bucket_count()?,
            buckets_capacity: u64::from(maps.bucket_capacity()?),
            buckets_evicted: {
                let g = maps.global_stats()?;
                Evictions {
                    full: g.counters[global::EVICTED_FULL],
                    lost: g.counters[global::EVICTED_LOST],
                }
            },
            reloads: self.reload.clone(),
            cluster: self.cluster_status(),
        })
    }

    /// The attached interfaces, and the configured ones that are missing.
    fn interface_status(&self) -> Vec<InterfaceStatus> {
        let state = |iface: &str| {
            if self.missing.contains(iface) {
                "missing"
            } else {
                "attached"
            }
        };
        let mut out: Vec<InterfaceStatus> = self
            .dp
            .attachments()
            .iter()
            .map(|a| InterfaceStatus {
                iface: a.iface.clone(),
                mode: a.mode.to_string(),
                state: state(&a.iface),
            })
            .collect();
        for iface in &self.missing {
            if !out.iter().any(|i| &i.iface == iface) {
                out.push(InterfaceStatus {
                    iface: iface.clone(),
                    mode: "-".to_string(),
                    state: "missing",
                });
            }
        }
        out
    }

    /// Counters.
    pub fn stats(&self) -> Result<StatsReport, AgentError> {
        Ok(StatsReport::read(self.dp.maps())?)
    }

    /// Every tracked bucket, with the time it was read (`CLOCK_MONOTONIC` ns).
    pub fn buckets(&self) -> Result<(u64, Vec<(BucketKey, Bucket)>), AgentError> {
        let now = monotonic_ns();
        Ok((now, self.dp.maps().buckets()?))
    }

    /// What happens to packets from `ip` whose protocol and port the program cannot know.
    fn cut_packets(&self, ip: IpAddr) -> CutPackets {
        use crate::compile::WithoutL4;
        let (verdict, rule) = match self.set.classify_without_l4(ip) {
            WithoutL4::Dependent => ("dropped", None),
            WithoutL4::NoRule => ("passed", None),
            WithoutL4::Rule(r) => ("rule", Some(r.name.clone())),
        };
        CutPackets {
            verdict,
            rule,
            why: match verdict {
                "dropped" => {
                    "a rule for this source looks at the protocol or port, which such a \
                              packet hides: tiny first fragments (and their datagrams) and IPv6 \
                              chains of more than 8 extension headers are dropped \
                              (dropped_tiny_fragments, dropped_long_chains)"
                }
                "passed" => "no rule's source prefix contains this address",
                _ => {
                    "no rule for this source looks at the protocol or port: such packets fall \
                      under its first rule"
                }
            }
            .to_string(),
        }
    }

    /// Which rule a packet from `ip` (with `protocol`/`dst_port`) falls under, why, and its bucket.
    pub fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
    ) -> Result<Explain, AgentError> {
        let prefix = self.set.lookup(ip);
        let candidates: Vec<String> = prefix
            .map(|p| {
                p.candidates()
                    .iter()
                    .filter_map(|&id| self.set.rule(id))
                    .map(|r| r.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        let cut = self.cut_packets(ip);
        let Some(rule) = self.set.classify(ip, protocol, dst_port) else {
            let why = match prefix {
                None => "no rule's source prefix contains this address: the packet passes".to_string(),
                Some(p) => format!(
                    "the longest matching prefix {} has rules [{}], none of which matches protocol {protocol} port {}: the packet passes",
                    p.net(),
                    candidates.join(", "),
                    dst_port.map_or_else(|| "-".to_string(), |p| p.to_string())
                ),
            };
            return Ok(Explain {
                ip,
                protocol,
                dst_port,
                rule: None,
                prefix: prefix.map(|p| p.net().to_string()),
                candidates,
                why,
                bucket: None,
                cut,
            });
        };
        let net = prefix.map(|p| p.net().to_string());
        let why = format!(
            "longest matching prefix {} ; candidates in order [{}] ; first matching protocol/port: {:?}",
            net.as_deref().unwrap_or("?"),
            candidates.join(", "),
            rule.name
        );
        let key = bucket_key(rule.id, &rule.rule, ip);
        let bucket = self
            .dp
            .maps()
            .bucket(&key)?
            .map(|b| BucketView::new(&b, &rule.rule, monotonic_ns()));
        let config = self
            .config
            .rules
            .iter()
            .find(|r| r.name == rule.name)
            .cloned();
        Ok(Explain {
            ip,
            protocol,
            dst_port,
            rule: Some(ExplainRule {
                name: rule.name.clone(),
                id: rule.id,
                line: rule.line,
                config,
            }),
            prefix: net,
            candidates,
            why,
            bucket,
            cut,
        })
    }

    /// Detaches from `iface`, or from every interface.
    pub fn detach(&mut self, iface: Option<&str>) -> Result<Vec<String>, AgentError> {
        let targets: Vec<String> = match iface {
            Some(i) => vec![i.to_string()],
            None => self
                .dp
                .attachments()
                .iter()
                .map(|a| a.iface.clone())
                .collect(),
        };
        let mut done = Vec::new();
        for t in targets {
            if self.dp.detach(&t)? {
                tracing::info!(iface = %t, "detached (API)");
                done.push(t);
            } else if iface.is_some() {
                return Err(AgentError::BadRequest(format!("not attached to {t:?}")));
            }
        }
        self.config.agent.interfaces.retain(|i| !done.contains(i));
        self.missing.retain(|i| !done.contains(i));
        Ok(done)
    }

    /// Ends the agent: detach and unpin everything, or with `keep_attached` leave it all in place.
    pub fn shutdown(self) -> Result<(), AgentError> {
        if self.opts.keep_attached {
            tracing::info!(pin_dir = %self.config.agent.pin_path.display(), "leaving the limiter attached (--keep-attached)");
            self.dp.keep_attached();
        } else {
            tracing::info!("detaching and removing pinned state");
            self.dp.remove()?;
        }
        Ok(())
    }

    /// Mutable access to the data plane (the eBPF log reader needs the object).
    pub fn dataplane_mut(&mut self) -> &mut Dataplane {
        &mut self.dp
    }
}

/// The pinned rules as (name, id, record) for [`RuleIds::from_installed`].
///
/// An install cut short (the agent killed while it wrote the next rule set) leaves the fresh ids
/// of the new and changed rules named next to the ids in force, so a name can appear twice. Every
/// named id stays reserved: handing one out again as a fresh id would overwrite a record that the
/// rules in force may use before the swap. The extra ones get a name no rule can have ('#' is not
/// allowed), so the first install frees them and purges their buckets.
fn installed_ids(
    named: std::collections::BTreeMap<u32, (String, u32, ratelimit_common::Rule)>,
) -> Vec<(String, u32, ratelimit_common::Rule)> {
    let mut seen = std::collections::HashSet::new();
    named
        .into_iter()
        .map(|(id, (name, _, rule))| {
            let name = if seen.insert(name.clone()) {
                name
            } else {
                format!("{name}#stale-{id}")
            };
            (name, id, rule)
        })
        .collect()
}

/// Writes the rules in force back to the config file (atomically, keeping comments).
fn write_back(path: &Path, rules: &[RuleConfig]) -> Result<(), AgentError> {
    Ok(crate::config::write_rules(path, rules)?)
}

fn flags_of(config: &Config) -> u32 {
    let mut flags = 0;
    if config.agent.dry_run {
        flags |= config_flags::DRY_RUN;
    }
    if config.agent.ebpf_log {
        flags |= config_flags::DEBUG_LOG;
    }
    flags
}

/// The bucket key the XDP program uses for `ip` under `rule`.
#[must_use]
pub fn bucket_key(id: u32, rule: &ratelimit_common::Rule, ip: IpAddr) -> BucketKey {
    let (fam, bytes) = match ip {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            (family::V4, b)
        }
        IpAddr::V6(a) => (family::V6, a.octets()),
    };
    let mut addr = [0u8; 16];
    for w in 0..4 {
        let word = u32::from_ne_bytes(bytes[w * 4..w * 4 + 4].try_into().expect("4 bytes"))
            & rule.src_mask[w];
        addr[w * 4..w * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    BucketKey {
        rule: id,
        family: fam,
        _pad: [0; 3],
        addr,
    }
}

/// The address (masked source) a bucket key stands for.
#[must_use]
pub fn bucket_addr(key: &BucketKey) -> IpAddr {
    if key.family == family::V4 {
        IpAddr::from([key.addr[0], key.addr[1], key.addr[2], key.addr[3]])
    } else {
        IpAddr::from(key.addr)
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `bpf_ktime_get_ns` reads.
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the clock `bpf_ktime_get_coarse_ns` reads, never
/// ahead of [`monotonic_ns`].
#[must_use]
pub fn monotonic_coarse_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists since Linux 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A bucket's state in user terms.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BucketView {
    /// Packet tokens available now (negative: in debt); `None` without a packet limit.
    pub tokens: Option<f64>,
    /// Byte tokens available now; `None` without a byte limit.
    pub byte_tokens: Option<f64>,
    /// Packets passed under this bucket since it was created.
    pub passed: u64,
    /// Packets dropped (or counted as dry-run drops) by this bucket.
    pub dropped: u64,
    /// Seconds since the bucket was created.
    pub age_secs: f64,
}

impl BucketView {
    /// Reads `b` under `rule` at `now` (`CLOCK_MONOTONIC` ns).
    #[must_use]
    pub fn new(b: &Bucket, rule: &ratelimit_common::Rule, now: u64) -> Self {
        use ratelimit_common::rule_flags;
        let level = |tat: u64, tolerance: u64, unit: f64| {
            // Tokens = (now + tolerance - max(tat, now)) / cost of one token.
            #[expect(clippy::cast_precision_loss, reason = "display only")]
            let v = (now as f64 + tolerance as f64 - tat.max(now) as f64) / unit;
            v
        };
        #[expect(clippy::cast_precision_loss, reason = "display only")]
        Self {
            tokens: (rule.flags & rule_flags::PKT_LIMIT != 0 && rule.pkt_interval_ns > 0)
                .then(|| level(b.tat_ns, rule.pkt_tolerance_ns, rule.pkt_interval_ns as f64)),
            byte_tokens: (rule.flags & rule_flags::BYTE_LIMIT != 0 && rule.byte_interval_fp > 0)
                .then(|| {
                    level(
                        b.byte_tat_ns,
                        rule.byte_tolerance_ns,
                        rule.byte_interval_fp as f64 / 65536.0,
                    )
                }),
            passed: u64::from(b.passed_pkts),
            dropped: u64::from(b.dropped_pkts),
            age_secs: now.saturating_sub(b.created_ns) as f64 / 1e9,
        }
    }
}

/// Buckets whose record a new source took (the program's own counters).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Evictions {
    /// The bucket had refilled: nothing lost.
    pub full: u64,
    /// The bucket had not refilled: its source starts full again if it comes back.
    pub lost: u64,
}

/// `status` output.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// Agent version.
    pub version: &'static str,
    /// Agent process id.
    pub pid: u32,
    /// Seconds since the agent started.
    pub uptime_secs: u64,
    /// Config file.
    pub config: String,
    /// Pin directory.
    pub pin_path: String,
    /// Control socket.
    pub socket: String,
    /// Attached interfaces.
    pub interfaces: Vec<InterfaceStatus>,
    /// Rules in force.
    pub rules: usize,
    /// Distinct source prefixes in force.
    pub prefixes: usize,
    /// Rule-set epoch: counts installs; its low bit is the prefix-trie half in force.
    pub generation: u32,
    /// Whole-agent dry run.
    pub dry_run: bool,
    /// Buckets tracked.
    pub buckets_tracked: u64,
    /// Bucket capacity.
    pub buckets_capacity: u64,
    /// Buckets evicted for new sources, by what the eviction lost.
    pub buckets_evicted: Evictions,
    /// Reload bookkeeping.
    pub reloads: ReloadState,
    /// Cluster members and counters, when `[cluster]` is set.
    pub cluster: Option<crate::cluster::ClusterStatus>,
}

/// One attached interface.
#[derive(Clone, Debug, Serialize)]
pub struct InterfaceStatus {
    /// Interface name.
    pub iface: String,
    /// native, skb or adopted ("-" while missing and not attached).
    pub mode: String,
    /// `attached`, or `missing`: the interface was deleted (the program went with it) and is
    /// attached again when an interface of that name appears.
    pub state: &'static str,
}

/// `explain` output.
#[derive(Clone, Debug, Serialize)]
pub struct Explain {
    /// The address asked about.
    pub ip: IpAddr,
    /// IP protocol number asked about (0: unspecified).
    pub protocol: u8,
    /// Destination port asked about.
    pub dst_port: Option<u16>,
    /// The matching rule, if any.
    pub rule: Option<ExplainRule>,
    /// The longest rule prefix containing the address.
    pub prefix: Option<String>,
    /// Rules listed for that prefix, in the order they are tried.
    pub candidates: Vec<String>,
    /// The decision in words.
    pub why: String,
    /// The source's bucket, if one is tracked.
    pub bucket: Option<BucketView>,
    /// What happens to the source's packets that hide their protocol or port (tiny first
    /// fragments, over-long IPv6 header chains). Fragments other than the first follow their
    /// datagram's first fragment.
    pub cut: CutPackets,
}

/// `explain`'s account of a source's packets whose protocol and port cannot be known.
#[derive(Clone, Debug, Serialize)]
pub struct CutPackets {
    /// `dropped`, `passed` (no rule), or `rule` (classified by [`CutPackets::rule`]).
    pub verdict: &'static str,
    /// The rule that applies when `verdict` is `rule`.
    pub rule: Option<String>,
    /// Why, in words.
    pub why: String,
}

/// The rule `explain` found.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainRule {
    /// Rule name.
    pub name: String,
    /// Rule id.
    pub id: u32,
    /// Config line.
    pub line: usize,
    /// The rule's settings.
    pub config: Option<RuleConfig>,
}

/// Runs the agent until SIGINT/SIGTERM: starts it, serves the control API and metrics, reloads on
/// SIGHUP and when the config file changes, then shuts down.
pub async fn run(opts: AgentOptions) -> Result<(), AgentError> {
    use tokio::signal::unix::{signal, SignalKind};
    let sig = |kind: SignalKind, name: &str| {
        signal(kind).map_err(|e| AgentError::Runtime(format!("installing the {name} handler: {e}")))
    };
    let (mut int, mut term, mut hup) = (
        sig(SignalKind::interrupt(), "SIGINT")?,
        sig(SignalKind::terminate(), "SIGTERM")?,
        sig(SignalKind::hangup(), "SIGHUP")?,
    );

    let config_path = opts.config_path.clone();
    // The control socket is bound before anything is loaded: if another agent answers on it,
    // this one stops here, before it could adopt and then tear down the other's pinned state.
    let socket = prepare(&opts)?.agent.socket;
    let listener = crate::api::bind(&socket)?;
    let agent = match Agent::start(opts) {
        Ok(agent) => agent,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
    };
    let metrics_addr = agent.config.agent.metrics;
    let (cluster, pin_dir) = (
        agent.config.cluster.clone(),
        agent.dp.pin_dir().to_path_buf(),
    );
    let agent: SharedAgent = Arc::new(Mutex::new(agent));

    let mut tasks = Vec::new();
    // Whatever `ebpf_log` says now: a reload can turn it on, and the program emits records only
    // while it is on.
    tasks.push(spawn_ebpf_log_reader(&agent).await?);
    tasks.push(crate::api::serve(listener, agent.clone()));
    if let Some(addr) = metrics_addr {
        match crate::metrics::serve(addr, agent.clone()).await {
            Ok(task) => tasks.push(task),
            Err(e) => {
                let _ = std::fs::remove_file(&socket);
                shutdown_shared(agent).await?;
                return Err(e);
            }
        }
    }
    if let Some(cluster) = cluster {
        match crate::cluster::spawn(&cluster, agent.clone(), &pin_dir).await {
            Ok((handle, task)) => {
                agent.lock().await.cluster = Some(handle);
                tasks.push(task);
            }
            Err(e) => {
                for task in tasks {
                    task.abort();
                }
                let _ = std::fs::remove_file(&socket);
                shutdown_shared(agent).await?;
                return Err(e);
            }
        }
    }
    tasks.push(spawn_config_watcher(config_path, agent.clone()));
    tasks.push(spawn_interface_watcher(agent.clone()));
    tracing::info!(socket = %socket.display(), "running; SIGHUP reloads, SIGINT or SIGTERM exits");

    loop {
        tokio::select! {
            _ = int.recv() => { tracing::info!("SIGINT"); break; }
            _ = term.recv() => { tracing::info!("SIGTERM"); break; }
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading");
                let _ = agent.lock().await.reload();
            }
        }
    }
    for task in tasks {
        task.abort();
        // Wait for it to go, so its reference to the agent is dropped before shutdown.
        let _ = task.await;
    }
    let _ = std::fs::remove_file(&socket);
    shutdown_shared(agent).await
}

async fn shutdown_shared(agent: SharedAgent) -> Result<(), AgentError> {
    match Arc::try_unwrap(agent) {
        Ok(mutex) => mutex.into_inner().shutdown(),
        Err(shared) => {
            // A task still holds a reference (it was just aborted): take the state out under the
            // lock by detaching directly.
            let mut guard = shared.lock().await;
            if guard.opts.keep_attached {
                return Ok(());
            }
            guard.dp.detach_all()?;
            crate::dataplane::remove_pin_dir(guard.dp.pin_dir())?;
            Ok(())
        }
    }
}

/// Polls the config file's identity and content every 250 ms and reloads when it changes.
///
/// Polling rather than inotify: editors and config managers replace files by rename, create them
/// anew or edit in place, and a poll of (inode, size, mtime) sees all of these without watching the
/// directory; 250 ms is far below what an operator notices.
fn spawn_config_watcher(path: PathBuf, agent: SharedAgent) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let stamp = |p: &Path| {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(p)
                .ok()
                .map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
        };
        // The config file and the list files (`source_file`) of the rules in force.
        let watched = |lists: Vec<PathBuf>| {
            std::iter::once(path.clone())
                .chain(lists)
                .map(|p| (stamp(&p), p))
                .collect::<Vec<_>>()
        };
        let mut last = watched(agent.lock().await.list_files());
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let lists = agent.lock().await.list_files();
            let now = watched(lists);
            if now != last {
                let changed: Vec<String> = now
                    .iter()
                    .filter(|n| !last.contains(n))
                    .map(|(_, p)| p.display().to_string())
                    .collect();
                let mut guard = agent.lock().await;
                // Our own write-back also changes the file: reloading it is harmless (same rules).
                tracing::info!(changed = ?changed, "config or list file changed: reloading");
                let _ = guard.reload();
                // Stamp after the reload: the rules in force may name other list files now.
                last = watched(guard.list_files());
            }
        }
    })
}

/// Every second, [`Agent::recheck_interfaces`]: notices deleted interfaces and attaches again to
/// re-created ones. (Polling: a few `if_nametoindex` calls a second cost nothing, and need no
/// netlink subscription that could overflow.)
fn spawn_interface_watcher(agent: SharedAgent) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            agent.lock().await.recheck_interfaces();
        }
    })
}

/// Forwards the program's aya-log records to the agent's log (only emitted when `ebpf_log` is on).
async fn spawn_ebpf_log_reader(
    agent: &SharedAgent,
) -> Result<tokio::task::JoinHandle<()>, AgentError> {
    let logger = EbpfLogger::init(agent.lock().await.dataplane_mut().ebpf_mut())
        .map_err(|e| AgentError::Runtime(format!("starting the eBPF log reader: {e}")))?;
    // SAFETY: the logger owns the ring buffer's fd and moves into the AsyncFd, so the fd stays
    // open for as long as it is registered.
    let mut fd = unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) }
        .map_err(|e| AgentError::Runtime(format!("polling the eBPF log ring buffer: {e}")))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_left_twice_by_an_interrupted_install_keeps_both_ids_reserved() {
        let rule = |rate: u64| ratelimit_common::Rule {
            pkt_interval_ns: rate,
            ..Default::default()
        };
        let named = [
            (0, ("a".to_owned(), 1, rule(1))),
            (3, ("b".to_owned(), 2, rule(2))),
            (5, ("b".to_owned(), 2, rule(3))),
        ];
        let ids = RuleIds::from_installed(installed_ids(named.into_iter().collect())).unwrap();
        assert_eq!(ids.len(), 3, "every named id stays installed");
        assert_eq!(ids.id_of("b"), Some(3));
        assert_eq!(ids.id_of("b#stale-5"), Some(5));
    }
}
