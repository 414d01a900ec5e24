//! The agent's state: the config and rule set in force, the data plane they are installed in, and
//! every change to them (start, reload, rules added or removed, interfaces rechecked, detach,
//! shutdown). It serves nothing itself: [`crate::daemon`] runs it and hands it to the servers
//! (the control API, the metrics endpoint, the watchers), and the cluster sync reads only the
//! rules in force ([`Agent::rules_in_force`]) and its own handles on the pinned maps.
//!
//! Everything that can be refused (config syntax, rule semantics, unknown interfaces) is checked
//! before anything on the host changes: at start, before the program is loaded; on a reload or an
//! API change, before the new rule set is swapped in. A refused change leaves the rules in force.
//!
//! `report.rs` holds what the agent shows of itself: `status` and `explain`.

mod reload;
mod report;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Instant, SystemTime},
};

use ratelimit_common::config_flags;
use serde::Serialize;
use tokio::sync::{watch, Mutex};

pub use self::report::{
    flag_names, CutPackets, Evictions, Explain, ExplainRule, InterfaceStatus, Status,
};
use crate::{
    compile::{compile, CompileError, CompiledRuleSet, RuleIds},
    config::{AgentConfig, AttachMode, Config, ConfigError, RuleConfig},
    dataplane::{Dataplane, DataplaneError, LinkHealth, LoadOptions},
    maps::MapsError,
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
    /// `rules add`/`remove` found the config file's rules different from those loaded (an edit
    /// not applied yet): writing the change back would drop that edit.
    #[error(
        "{path}: the file's rules differ from the rules in force ({what}): writing this change \
         back would drop that edit. Apply the file first (`ratelimit rules reload`), or pass \
         --force to write the rules in force plus this change over it"
    )]
    FileChanged {
        /// The config file.
        path: String,
        /// How the file differs.
        what: String,
    },
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
    /// State directory from the command line; overrides the config's `state_dir`.
    pub state_dir: Option<PathBuf>,
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
    if let Some(dir) = &opts.state_dir {
        if !dir.is_absolute() {
            return Err(AgentError::BadRequest(format!(
                "--state-dir {}: must be an absolute path",
                dir.display()
            )));
        }
        config.agent.state_dir.clone_from(dir);
    }
    if config.agent.interfaces.is_empty() {
        return Err(AgentError::NoInterfaces(opts.config_path.clone()));
    }
    check_interfaces(&config.agent.interfaces, &origin)?;
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
    set: Arc<CompiledRuleSet>,
    dp: Dataplane,
    reload: ReloadState,
    started: Instant,
    /// The rule set in force, for readers outside the lock (the cluster sync): replaced on every
    /// install.
    in_force: watch::Sender<Arc<CompiledRuleSet>>,
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
            object: None,
        })?;
        // Ids of rules already installed (a previous agent's pinned state) are kept, so unchanged
        // rules keep their buckets across a restart.
        let installed = dp.maps().named_rules()?;
        let adopted = !installed.is_empty();
        let ids = RuleIds::from_installed(installed_ids(installed)).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "pinned rule ids unusable; assigning new ones");
            RuleIds::new()
        });
        let set = Arc::new(compile(&[], &ids).map_err(|source| AgentError::Compile {
            origin: "empty rule set".into(),
            source,
        })?);
        let mut agent = Self {
            opts,
            config: config.clone(),
            ids,
            set: set.clone(),
            dp,
            reload: ReloadState::default(),
            started: Instant::now(),
            in_force: watch::Sender::new(set),
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
        self.set = Arc::new(set);
        self.in_force.send_replace(self.set.clone());
        self.config.rules = rules.to_vec();
        Ok(())
    }

    /// Replaces the rule set (from the API): validated whole, swapped in atomically, then written
    /// back to the config file. Counts as a reload.
    ///
    /// Unless `force`, refused (and not counted) when the file's rules are not those in force,
    /// so that an edit not loaded yet is never overwritten.
    pub fn replace_rules(
        &mut self,
        rules: Vec<RuleConfig>,
        origin: &str,
        force: bool,
    ) -> Result<(), AgentError> {
        if !force {
            self.check_file_unchanged()?;
        }
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

    /// Refuses when the config file's rules (and the lists they name) are not the rules in force.
    fn check_file_unchanged(&self) -> Result<(), AgentError> {
        let path = self.opts.config_path.display().to_string();
        let on_disk = match Config::load(&self.opts.config_path) {
            Ok(c) => c,
            Err(e) => {
                return Err(AgentError::FileChanged {
                    path,
                    what: format!("it does not load: {e}"),
                })
            }
        };
        match rules_difference(&self.config.rules, &on_disk.rules) {
            None => Ok(()),
            Some(what) => Err(AgentError::FileChanged { path, what }),
        }
    }

    /// Adds one rule (from the API).
    pub fn add_rule(&mut self, rule: RuleConfig, force: bool) -> Result<(), AgentError> {
        if self.config.rules.iter().any(|r| r.name == rule.name) {
            return Err(AgentError::RuleExists(rule.name));
        }
        let mut rules = self.config.rules.clone();
        let name = rule.name.clone();
        rules.push(rule);
        self.replace_rules(rules, &format!("rules add {name:?}"), force)
    }

    /// Sets the packet `rate` and `burst` of limit `limit` (1 its own, 2.. its
    /// `[[rule.limit]]`s) of the rule named `name` (`suggest --apply`): validated as a rule of
    /// `rules add` is, applied whole with the others, written back.
    pub fn set_packet_limit(
        &mut self,
        name: &str,
        (limit, rate, burst): (usize, u64, u64),
        force: bool,
    ) -> Result<(), AgentError> {
        let mut rules = self.config.rules.clone();
        let rule = rules
            .iter_mut()
            .find(|r| r.name == name)
            .ok_or_else(|| AgentError::NoSuchRule(name.to_string()))?;
        let no_limit = || AgentError::BadRequest(format!("rule {name:?} has no limit {limit}"));
        match limit {
            0 => return Err(no_limit()),
            1 => (rule.rate, rule.burst) = (Some(rate), Some(burst)),
            k => {
                let l = rule.limits.get_mut(k - 2).ok_or_else(no_limit)?;
                (l.rate, l.burst) = (Some(rate), Some(burst));
            }
        }
        rule.validate()
            .map_err(|e| AgentError::BadRequest(format!("rule {name:?}: {e}")))?;
        self.replace_rules(
            rules,
            &format!("suggest --apply {name:?} limit {limit}"),
            force,
        )
    }

    /// Removes one rule by name (from the API).
    pub fn remove_rule(&mut self, name: &str, force: bool) -> Result<(), AgentError> {
        let mut rules = self.config.rules.clone();
        let before = rules.len();
        rules.retain(|r| r.name != name);
        if rules.len() == before {
            return Err(AgentError::NoSuchRule(name.to_string()));
        }
        self.replace_rules(rules, &format!("rules remove {name:?}"), force)
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

    /// The rule set in force now and after every change, without the agent's lock (the cluster
    /// sync reads its cluster-scoped rules each round).
    #[must_use]
    pub fn rules_in_force(&self) -> watch::Receiver<Arc<CompiledRuleSet>> {
        self.in_force.subscribe()
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

    /// [`Agent::shutdown`] for an agent still shared (a task that held it was just aborted):
    /// detaches and unpins directly, unless `keep_attached`. The agent must not be used after.
    pub fn shutdown_in_place(&mut self) -> Result<(), AgentError> {
        if self.opts.keep_attached {
            return Ok(());
        }
        self.dp.detach_all()?;
        crate::dataplane::remove_pin_dir(self.dp.pin_dir())?;
        Ok(())
    }

    /// From now on, [`Agent::shutdown`] leaves the limiter attached as `--keep-attached` does.
    pub fn keep_attached(&mut self) {
        self.opts.keep_attached = true;
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

/// How the rules in a file (`on_disk`) differ from those `loaded`, in words; `None` when they are
/// the same (their line numbers apart).
fn rules_difference(loaded: &[RuleConfig], on_disk: &[RuleConfig]) -> Option<String> {
    let find = |set: &[RuleConfig], name: &str| set.iter().position(|r| r.name == name);
    let mut what = Vec::new();
    for r in on_disk {
        match find(loaded, &r.name) {
            None => what.push(format!("rule {:?} added", r.name)),
            Some(i) => {
                let mut l = loaded[i].clone();
                l.line = r.line;
                if l != *r {
                    what.push(format!("rule {:?} changed", r.name));
                }
            }
        }
    }
    for r in loaded {
        if find(on_disk, &r.name).is_none() {
            what.push(format!("rule {:?} removed", r.name));
        }
    }
    if what.is_empty() {
        let order = |set: &[RuleConfig]| set.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
        if order(loaded) != order(on_disk) {
            what.push("rules reordered".to_string());
        }
    }
    (!what.is_empty()).then(|| what.join(", "))
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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
