//! The daemon: `ratelimit agent`. Starts the agent ([`crate::agent`]), then runs what serves and
//! watches it, each handed only what it needs:
//! - the bucket census ([`crate::census`]), over handles on the pinned maps of its own;
//! - the control API ([`crate::api`]) on the Unix socket, and the metrics endpoint
//!   ([`crate::metrics`]): the shared agent, what they read without its lock (the census, the
//!   pinned maps, the rules in force), and the cluster handle for its status;
//! - the cluster sync ([`crate::cluster`]): the rules in force and the pin directory;
//! - the config watcher (reload when the config or a list file changes), the interface watcher
//!   (deleted and re-created interfaces), SIGHUP (reload), the eBPF log reader;
//!
//! and on SIGINT or SIGTERM stops them all before the agent shuts down (detaches, or leaves the
//! limiter enforcing with `--keep-attached`).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use aya_log::EbpfLogger;
use tokio::{
    io::unix::AsyncFd,
    net::UnixListener,
    signal::unix::{signal, Signal, SignalKind},
    sync::{watch, Mutex},
    task::JoinHandle,
};

use crate::{
    agent::{self, Agent, AgentError, AgentOptions, SharedAgent},
    api,
    census::ReadSide,
    cluster::{self, ClusterHandle},
    compile::CompiledRuleSet,
    config::Config,
    learn::LearnHandle,
    metrics,
};

/// Runs the agent until SIGINT/SIGTERM: starts it, serves the control API and metrics, runs the
/// cluster sync, reloads on SIGHUP and when the config file changes, then shuts down.
pub async fn run(opts: AgentOptions) -> Result<(), AgentError> {
    let mut signals = Signals::install()?;
    let Started {
        agent,
        config,
        listener,
        socket,
        config_path,
        first_stamps,
        pin_dir,
        rules,
        read_rules,
    } = start(opts)?;

    // Each server gets what it serves: the agent, and the cluster's handle for its status.
    let mut tasks = Vec::new();
    let socket_path = &socket;
    let fail = |tasks: Vec<JoinHandle<()>>, agent: SharedAgent, e: AgentError| async move {
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
        let _ = std::fs::remove_file(socket_path);
        shutdown_shared(agent).await?;
        Err(e)
    };
    // Whatever `ebpf_log` says now: a reload can turn it on, and the program emits records only
    // while it is on.
    match spawn_ebpf_log_reader(&agent).await {
        Ok(task) => tasks.push(task),
        Err(e) => return fail(tasks, agent, e).await,
    }
    let mut cluster_handle = None;
    if let Some(cluster) = &config.cluster {
        match cluster::spawn(cluster, rules, &pin_dir).await {
            Ok((handle, task)) => {
                cluster_handle = Some(handle);
                tasks.push(task);
            }
            Err(e) => return fail(tasks, agent, runtime(e)).await,
        }
    }
    // The servers' own handles on the pinned maps and the bucket census: what they read without
    // the agent's lock.
    let read = match ReadSide::start(&pin_dir, read_rules) {
        Ok((read, task)) => {
            tasks.push(task);
            read
        }
        Err(e) => return fail(tasks, agent, e.into()).await,
    };
    let learn = spawn_servers(&mut tasks, &agent, &config, listener, read, cluster_handle).await;
    tasks.push(spawn_config_watcher(
        config_path,
        first_stamps,
        agent.clone(),
    ));
    tasks.push(spawn_interface_watcher(agent.clone()));
    tracing::info!(socket = %socket.display(), "running; SIGHUP reloads, SIGINT or SIGTERM exits");
    crate::notify::ready("enforcing");

    signals.wait_for_exit(&agent).await;
    stop(tasks, &socket, learn, agent).await
}

/// The signals the daemon answers.
struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
    usr2: Signal,
}

impl Signals {
    /// Installs the handlers, before the agent starts: from then on these signals reach
    /// [`Signals::wait_for_exit`] instead of their default action.
    fn install() -> Result<Self, AgentError> {
        let sig = |kind: SignalKind, name: &str| {
            signal(kind)
                .map_err(|e| AgentError::Runtime(format!("installing the {name} handler: {e}")))
        };
        let (int, term, hup) = (
            sig(SignalKind::interrupt(), "SIGINT")?,
            sig(SignalKind::terminate(), "SIGTERM")?,
            sig(SignalKind::hangup(), "SIGHUP")?,
        );
        // SIGUSR2: exit as with --keep-attached, for a package upgrade's restart (see
        // debian/postinst).
        let usr2 = sig(SignalKind::user_defined2(), "SIGUSR2")?;
        Ok(Self {
            int,
            term,
            hup,
            usr2,
        })
    }

    /// Reloads on SIGHUP until SIGINT, SIGTERM or SIGUSR2 (which leaves the limiter attached at
    /// shutdown) comes; each reload holds the agent's lock throughout.
    async fn wait_for_exit(&mut self, agent: &SharedAgent) {
        loop {
            tokio::select! {
                _ = self.int.recv() => { tracing::info!("SIGINT"); break; }
                _ = self.term.recv() => { tracing::info!("SIGTERM"); break; }
                _ = self.usr2.recv() => {
                    tracing::info!(
                        "SIGUSR2: exiting, leaving the limiter attached for the next agent"
                    );
                    agent.lock().await.keep_attached();
                    break;
                }
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP: reloading");
                    crate::notify::reloading();
                    let mut guard = agent.lock().await;
                    // Reading files: off the runtime's worker threads.
                    let _ = tokio::task::block_in_place(|| guard.reload());
                    crate::notify::ready("enforcing");
                }
            }
        }
    }
}

/// The agent as [`start`] leaves it, shared, and what its servers and watchers are handed.
struct Started {
    agent: SharedAgent,
    /// The config in force at start.
    config: Config,
    /// The control socket, bound, and its path (removed at exit).
    listener: UnixListener,
    socket: PathBuf,
    config_path: PathBuf,
    /// The config and list files' stamps, taken before they were read.
    first_stamps: Vec<(Stamp, PathBuf)>,
    pin_dir: PathBuf,
    /// The rules in force, for the cluster sync and for the servers' read side.
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    read_rules: watch::Receiver<Arc<CompiledRuleSet>>,
}

/// Checks the config, binds the control socket, then starts the agent (loads, installs,
/// attaches); the socket file is removed again if the agent does not start.
fn start(opts: AgentOptions) -> Result<Started, AgentError> {
    let config_path = opts.config_path.clone();
    // Stamped before it is read: an edit made while the agent starts is seen by the watcher.
    let config_stamp = file_stamp(&config_path);
    let prepared = agent::prepare(&opts)?;
    if let Some(cluster) = &prepared.cluster {
        cluster::check(cluster).map_err(runtime)?;
    }
    // The control socket is bound before anything is loaded: if another agent answers on it,
    // this one stops here, before it could adopt and then tear down the other's pinned state.
    let socket = prepared.agent.socket;
    let listener = api::bind(&socket)?;
    let agent = match Agent::start(opts) {
        Ok(agent) => agent,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
    };
    let config = agent.config().clone();
    let first_stamps: Vec<_> = std::iter::once((config_stamp, config_path.clone()))
        .chain(stamps(agent.list_files()))
        .collect();
    let pin_dir = agent.dataplane().pin_dir().to_path_buf();
    let rules = agent.rules_in_force();
    let read_rules = agent.rules_in_force();
    let agent: SharedAgent = Arc::new(Mutex::new(agent));
    Ok(Started {
        agent,
        config,
        listener,
        socket,
        config_path,
        first_stamps,
        pin_dir,
        rules,
        read_rules,
    })
}

/// Starts the learner (unless `learn = false`), the metrics endpoint (if configured) and the
/// control API, each task pushed onto `tasks`; none of them can fail the start. Returns the
/// learner, whose history is saved at exit.
async fn spawn_servers(
    tasks: &mut Vec<JoinHandle<()>>,
    agent: &SharedAgent,
    config: &Config,
    listener: UnixListener,
    read: ReadSide,
    cluster_handle: Option<ClusterHandle>,
) -> Option<LearnHandle> {
    // What the traffic teaches (`suggest`): its own walk of the store, its history kept in the
    // state directory; none with `learn = false` (`suggest` then says the agent is not learning).
    let learn = config.agent.learn.then(|| {
        let (learn, task) = crate::learn::spawn(
            read.maps.clone(),
            read.rules.clone(),
            Some(config.agent.state_dir.clone()),
        );
        tasks.push(task);
        learn
    });
    // An address that cannot be bound does not stop the agent: the endpoint says so in the log
    // and in `status`, and binds when the address is free (see [`metrics::serve`]).
    let mut metrics_handle = None;
    if let Some(addr) = config.agent.metrics {
        let (handle, task) = metrics::serve(
            addr,
            agent.clone(),
            cluster_handle.clone(),
            read.clone(),
            learn.clone(),
        )
        .await;
        metrics_handle = Some(handle);
        tasks.push(task);
    }
    tasks.push(api::serve(
        listener,
        api::ApiState::new(agent.clone(), read, cluster_handle)
            .with_metrics(metrics_handle)
            .with_learner(learn.clone()),
    ));
    learn
}

/// Stops every task, removes the socket, saves what was learned, then shuts the agent down
/// (detaches, or leaves the limiter enforcing with `--keep-attached`). The tasks go first, so
/// that their references to the agent are dropped before it shuts down.
async fn stop(
    tasks: Vec<JoinHandle<()>>,
    socket: &Path,
    learn: Option<LearnHandle>,
    agent: SharedAgent,
) -> Result<(), AgentError> {
    crate::notify::stopping();
    for task in tasks {
        task.abort();
        // Wait for it to go, so its reference to the agent is dropped before shutdown.
        let _ = task.await;
    }
    let _ = std::fs::remove_file(socket);
    // The history learned so far, for the next agent.
    if let Some(learn) = learn {
        let _ = tokio::task::spawn_blocking(move || learn.save()).await;
    }
    shutdown_shared(agent).await
}

fn runtime(e: impl std::fmt::Display) -> AgentError {
    AgentError::Runtime(e.to_string())
}

async fn shutdown_shared(agent: SharedAgent) -> Result<(), AgentError> {
    match Arc::try_unwrap(agent) {
        Ok(mutex) => mutex.into_inner().shutdown(),
        // A task still holds a reference (it was just aborted): shut down under the lock.
        Err(shared) => shared.lock().await.shutdown_in_place(),
    }
}

/// A file's identity and content stamp: (inode, size, mtime), or `None` when it cannot be read.
type Stamp = Option<(u64, u64, i64, i64)>;

fn file_stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(p)
        .ok()
        .map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

fn stamps(paths: impl IntoIterator<Item = PathBuf>) -> impl Iterator<Item = (Stamp, PathBuf)> {
    paths.into_iter().map(|p| (file_stamp(&p), p))
}

/// Polls the config file's identity and content every 250 ms and reloads when it changes.
///
/// Polling rather than inotify: editors and config managers replace files by rename, create them
/// anew or edit in place, and a poll of (inode, size, mtime) sees all of these without watching the
/// directory; 250 ms is far below what an operator notices. `first` holds the stamps taken when
/// the files were read (before this task runs), so an edit made meanwhile is not missed.
fn spawn_config_watcher(
    path: PathBuf,
    first: Vec<(Stamp, PathBuf)>,
    agent: SharedAgent,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // The config file and the list files (`source_file`) of the rules in force.
        let watched = |lists: Vec<PathBuf>| {
            stamps(std::iter::once(path.clone()).chain(lists)).collect::<Vec<_>>()
        };
        let mut last = first;
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
                // Stamped before the reload reads them, so an edit made during it is seen next
                // tick; list files the new rules name are stamped after (they had none before).
                let before = watched(guard.list_files());
                let _ = tokio::task::block_in_place(|| guard.reload());
                last = Vec::new();
                for p in std::iter::once(path.clone()).chain(guard.list_files()) {
                    let stamp = match before.iter().find(|(_, q)| *q == p) {
                        Some((s, _)) => *s,
                        None => file_stamp(&p),
                    };
                    last.push((stamp, p));
                }
            }
        }
    })
}

/// Every second, [`Agent::recheck_interfaces`]: notices deleted interfaces and attaches again to
/// re-created ones. (Polling: a few `if_nametoindex` calls a second cost nothing, and need no
/// netlink subscription that could overflow.)
fn spawn_interface_watcher(agent: SharedAgent) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            agent.lock().await.recheck_interfaces();
        }
    })
}

/// Forwards the program's aya-log records to the agent's log (only emitted when `ebpf_log` is on).
async fn spawn_ebpf_log_reader(agent: &SharedAgent) -> Result<JoinHandle<()>, AgentError> {
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
