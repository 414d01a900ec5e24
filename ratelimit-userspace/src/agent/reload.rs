//! A reload of the config file (SIGHUP, `rules reload`, the file watcher): everything validated
//! first, then the new interfaces attached, the rules swapped and the flags set, each step undone
//! if a later one fails; what only a restart applies is kept as in force and named in `status`.

use super::*;

impl Agent {
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

    // Validates, then applies with each step undone on a later failure. The steps that change
    // the host and their undoing stay here, in order, so that each rollback is read beside the
    // steps it undoes.
    fn reload_inner(&mut self) -> Result<(), AgentError> {
        let new = self.read_config_for_reload()?;
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
        // Everything validated. The new interfaces are attached first (running the rules in force
        // for a moment), then the rules swapped: a failure at any step undoes the earlier ones, so
        // a refused reload leaves the rules, the interfaces and `config.agent` as they were.
        let attached = self.attach_added(&added, new.agent.mode)?;
        let previous = self.config.rules.clone();
        if let Err(e) = self.install_rules(&new.rules, &origin) {
            undo_attach(&mut self.dp, &attached);
            return Err(e);
        }
        if let Err(e) = self.dp.set_flags(flags_of(&new)) {
            if let Err(undo) = self.install_rules(&previous, "restoring the rules in force") {
                tracing::error!(error = %undo, "restoring the rules after a failed reload");
            }
            undo_attach(&mut self.dp, &attached);
            return Err(e.into());
        }
        let interfaces = self.detach_left_out(&old_ifaces, &new.agent.interfaces);
        let (agent, restart) = live_settings(&self.config, &new, interfaces);
        self.config.agent = agent;
        self.reload.restart_needed = restart;
        tracing::info!(rules = self.set.rules.len(), "reloaded");
        Ok(())
    }

    /// The config file as a reload reads it, with the command-line overrides applied; refused
    /// when it names no interface. Nothing on the host is touched.
    fn read_config_for_reload(&self) -> Result<Config, AgentError> {
        let mut new = Config::load(&self.opts.config_path)?;
        if !self.opts.interfaces.is_empty() {
            new.agent.interfaces.clone_from(&self.opts.interfaces);
        }
        if let Some(mode) = self.opts.mode {
            new.agent.mode = mode;
        }
        if let Some(dir) = &self.opts.state_dir {
            new.agent.state_dir.clone_from(dir);
        }
        // Refused at start, so refused here too: otherwise a file emptied by accident (a config
        // manager truncating it, a botched edit) would detach every interface and drop the rules.
        // `ratelimit detach` is the way to stop enforcing on purpose.
        if new.agent.interfaces.is_empty() {
            return Err(AgentError::NoInterfaces(self.opts.config_path.clone()));
        }
        Ok(new)
    }

    /// Attaches to each of the interfaces a reload `added`, in order. Returns those attached; if
    /// one fails, detaches those attached before it, so that the interfaces are as they were.
    fn attach_added(
        &mut self,
        added: &[String],
        mode: AttachMode,
    ) -> Result<Vec<String>, AgentError> {
        let mut attached: Vec<String> = Vec::new();
        for iface in added {
            match self.dp.attach(iface, mode) {
                Ok(att) => {
                    tracing::info!(iface = %att.iface, mode = att.mode, "attached (reload)");
                    attached.push(iface.clone());
                }
                Err(e) => {
                    undo_attach(&mut self.dp, &attached);
                    return Err(e.into());
                }
            }
        }
        Ok(attached)
    }

    /// Detaches from the interfaces of `old` that `new` leaves out, once the reload is in force.
    /// Returns the interfaces configured from now on: `new`, and those whose detach failed.
    fn detach_left_out(&mut self, old: &[String], new: &[String]) -> Vec<String> {
        // Interfaces left out of the config: a detach that fails keeps the interface configured
        // (and attached), so what the agent reports stays what is on the host.
        let mut interfaces = new.to_vec();
        for iface in old.iter().filter(|i| !new.contains(i)) {
            match self.dp.detach(iface) {
                Ok(_) => {
                    self.missing.remove(iface);
                    tracing::info!(iface = %iface, "detached (reload)");
                }
                Err(e) => {
                    tracing::error!(iface = %iface, error = %e, "detaching (reload) failed; it stays attached");
                    interfaces.push(iface.clone());
                }
            }
        }
        interfaces
    }
}

/// Detaches from the interfaces a refused reload had `attached`, so that they are as they were.
fn undo_attach(dp: &mut Dataplane, attached: &[String]) {
    for iface in attached {
        if let Err(e) = dp.detach(iface) {
            tracing::error!(iface = %iface, error = %e, "undoing an attach of a refused reload");
        }
    }
}

/// The `[agent]` settings in force after a reload, and the settings of `[agent]` and `[cluster]`
/// that `new` changes but only a restart applies: `new`'s, but those in force (`old`'s) for what
/// needs a restart, and `interfaces` as the reload left them.
fn live_settings(
    old: &Config,
    new: &Config,
    interfaces: Vec<String>,
) -> (AgentConfig, Vec<String>) {
    let mut agent = new.agent.clone();
    let mut restart = keep_in_force(&old.agent, &mut agent);
    if old.cluster != new.cluster {
        restart.push("cluster".to_string());
    }
    agent.interfaces = interfaces;
    (agent, restart)
}

/// Puts back in `new` each `[agent]` setting that only a restart applies where it differs from
/// `a`'s (the one in force), and names those it put back: the one list of such settings.
fn keep_in_force(a: &AgentConfig, new: &mut AgentConfig) -> Vec<String> {
    let mut kept = Vec::new();
    macro_rules! keep {
        ($($field:ident),*) => {$(
            if new.$field != a.$field {
                kept.push(stringify!($field).to_string());
                new.$field.clone_from(&a.$field);
            }
        )*};
    }
    keep!(
        mode,
        socket,
        metrics,
        max_buckets,
        pin_path,
        log_format,
        state_dir,
        learn
    );
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each setting a reload cannot apply is named for a restart and stays as in force; the
    /// settings it can apply (`dry_run`, `ebpf_log`, `interfaces`) are taken.
    #[test]
    fn a_reload_names_each_setting_left_for_a_restart_and_keeps_it() {
        use crate::config::LogFormat;
        let old = Config {
            agent: AgentConfig::default(),
            rules: Vec::new(),
            cluster: None,
        };
        let mut new = old.clone();
        let b = &mut new.agent;
        b.mode = AttachMode::Skb;
        b.socket = "/run/other.sock".into();
        b.metrics = Some("127.0.0.1:9999".parse().unwrap());
        b.max_buckets = old.agent.max_buckets * 2;
        b.pin_path = "/sys/fs/bpf/other".into();
        b.log_format = LogFormat::Json;
        b.state_dir = "/var/lib/other".into();
        b.learn = !old.agent.learn;
        b.dry_run = !old.agent.dry_run;
        b.ebpf_log = !old.agent.ebpf_log;
        let (live, restart) = live_settings(&old, &new, vec!["eth9".into()]);
        assert_eq!(
            restart,
            [
                "mode",
                "socket",
                "metrics",
                "max_buckets",
                "pin_path",
                "log_format",
                "state_dir",
                "learn"
            ]
        );
        let mut expected = old.agent.clone();
        expected.dry_run = new.agent.dry_run;
        expected.ebpf_log = new.agent.ebpf_log;
        expected.interfaces = vec!["eth9".into()];
        assert_eq!(live, expected);
        // Nothing changed: nothing left for a restart.
        assert!(live_settings(&old, &old.clone(), Vec::new()).1.is_empty());
    }
}
