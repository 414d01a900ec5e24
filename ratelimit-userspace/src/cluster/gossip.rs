//! chitchat's server, supervised. A socket error chitchat cannot recover from (EMFILE, ENFILE,
//! port exhaustion) ends its loop for good; left alone, gossip would stop, peers go silent and
//! the cluster budget silently become per-host. [`Gossip::supervise`], called every sync round,
//! sees the loop end and starts a new one, with backoff.
//!
//! A restarted loop is a new incarnation (a new generation): chitchat's state starts empty, and
//! peers ignore versions of an incarnation they already hold, so the same generation would have
//! its keys ignored until it outgrew its old version. Peers see what they see when an agent
//! restarts: the new generation supersedes the old one and is counted from a new baseline (what
//! it admitted while gossip was down is not charged late: fail open). The keys published so far
//! are carried over.

use std::{
    future::Future,
    pin::Pin,
    sync::{atomic::Ordering::Relaxed, Arc},
    time::{Duration, Instant},
};

use chitchat::{spawn_chitchat, transport::Transport, ChitchatConfig, ChitchatHandle};

use super::{publish::SYNC_KEY, status::Shared};

/// First wait before restarting a loop that ended; doubled while restarts keep failing or the
/// loop keeps ending soon after a restart, up to [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
/// Longest wait between restarts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A loop that ran this long before ending restarts after [`MIN_BACKOFF`] again.
const STABLE: Duration = Duration::from_secs(60);

/// Seals `id` into the datagrams sent from now on (see [`super::wire::sender_tag`]).
pub fn set_self_tag(shared: &Shared, id: &chitchat::ChitchatId) {
    shared.self_tag.store(
        super::wire::sender_tag(&id.node_id, id.generation_id),
        Relaxed,
    );
}

type Ended = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// A transport for chitchat while its socket cannot be opened: sends go nowhere, nothing is
/// heard, so peers are silent and this host enforces alone (see [`Gossip::spawn`]).
struct Unbound;

struct UnboundSocket(std::net::SocketAddr);

#[async_trait::async_trait]
impl Transport for Unbound {
    async fn open(
        &self,
        listen_addr: std::net::SocketAddr,
    ) -> anyhow::Result<Box<dyn chitchat::transport::Socket>> {
        Ok(Box::new(UnboundSocket(listen_addr)))
    }
}

#[async_trait::async_trait]
impl chitchat::transport::Socket for UnboundSocket {
    fn local_addr(&self) -> anyhow::Result<std::net::SocketAddr> {
        Ok(self.0)
    }
    async fn send(
        &mut self,
        _to: std::net::SocketAddr,
        _envelope: chitchat::ChitchatEnvelope,
    ) -> anyhow::Result<chitchat::transport::SendOutcome> {
        Ok(chitchat::transport::SendOutcome { num_bytes_sent: 0 })
    }
    async fn recv(&mut self) -> anyhow::Result<chitchat::transport::RecvOutcome> {
        std::future::pending().await
    }
}

/// chitchat's server and what it takes to start it again.
pub struct Gossip {
    handle: ChitchatHandle,
    ended: Ended,
    started: Instant,
    /// Set while the loop is down: when to try again.
    retry_at: Option<Instant>,
    backoff: Duration,
    min_backoff: Duration,
    config: Box<dyn Fn(u64) -> ChitchatConfig + Send>,
    transport: Box<dyn Transport>,
    shared: Arc<Shared>,
}

impl Gossip {
    /// Starts chitchat with `config(generation)` over `transport`.
    ///
    /// If its socket cannot be opened (the gossip address is taken by another process, say),
    /// gossip starts down instead of failing: the error is logged and shown (`gossip`
    /// `restarting` with the error), this host enforces its cluster budgets alone, as when its
    /// peers are silent (fail open), and [`Gossip::supervise`] opens the socket again with
    /// backoff until it succeeds. Meanwhile chitchat keeps its state over a transport that
    /// sends and hears nothing, so the sync loop publishes and reads as usual.
    pub async fn spawn(
        generation: u64,
        config: Box<dyn Fn(u64) -> ChitchatConfig + Send>,
        transport: Box<dyn Transport>,
        shared: Arc<Shared>,
        min_backoff: Duration,
    ) -> anyhow::Result<Self> {
        let first = config(generation);
        set_self_tag(&shared, &first.chitchat_id);
        let listen = first.listen_addr;
        let (handle, down) = match spawn_chitchat(first, Vec::new(), &*transport).await {
            Ok(handle) => (handle, None),
            Err(e) => {
                let error = format!("{e:#}");
                tracing::error!(
                    listen = %listen,
                    error = %error,
                    retry_in_ms = u64::try_from(min_backoff.as_millis()).unwrap_or(u64::MAX),
                    "cluster gossip NOT running: cannot open the gossip socket at {listen}; this \
                     host enforces its cluster budgets alone (fail open) until it can, retrying"
                );
                let handle = spawn_chitchat(config(generation), Vec::new(), &Unbound).await?;
                (handle, Some(error))
            }
        };
        let gossip = Self {
            ended: Box::pin(handle.termination_watcher()),
            handle,
            started: Instant::now(),
            retry_at: down.as_ref().map(|_| Instant::now() + min_backoff),
            backoff: min_backoff,
            min_backoff,
            config,
            transport,
            shared,
        };
        if let Some(error) = down {
            gossip.set_down(error);
        }
        Ok(gossip)
    }

    /// The server (while the loop is down, the last one: its state is frozen, so its peers go
    /// silent and stop being counted).
    #[must_use]
    pub fn handle(&self) -> &ChitchatHandle {
        &self.handle
    }

    /// Whether chitchat's loop runs.
    #[must_use]
    pub fn running(&self) -> bool {
        self.retry_at.is_none()
    }

    /// Notices that the loop ended and restarts it when its backoff has passed; returns whether
    /// it runs. Never waits.
    pub async fn supervise(&mut self) -> bool {
        if self.retry_at.is_none() {
            let ended = tokio::select! {
                biased;
                r = &mut self.ended => Some(r),
                () = std::future::ready(()) => None,
            };
            let Some(result) = ended else { return true };
            let ran = self.started.elapsed();
            if ran >= STABLE {
                self.backoff = self.min_backoff;
            }
            let error = match result {
                Ok(()) => "ended".to_string(),
                Err(e) => format!("{e:#}"),
            };
            tracing::error!(
                error = %error,
                ran_s = ran.as_secs(),
                retry_in_ms = self.backoff.as_millis(),
                "cluster gossip stopped: peers are not heard and not counted until it restarts"
            );
            self.set_down(error);
            self.retry_at = Some(Instant::now() + self.backoff);
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        self.restart().await
    }

    async fn restart(&mut self) -> bool {
        let old = self.handle.chitchat_id().generation_id;
        let generation = super::unix_ms().max(old + 1);
        let carried: Vec<(String, String)> = self
            .handle
            .with_chitchat(|c| {
                c.self_node_state()
                    .key_values()
                    .filter(|(k, _)| *k != SYNC_KEY)
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .await;
        let counters = &self.shared.counters;
        counters.gossip_restarts.fetch_add(1, Relaxed);
        let config = (self.config)(generation);
        set_self_tag(&self.shared, &config.chitchat_id);
        match spawn_chitchat(config, carried, &*self.transport).await {
            Ok(handle) => {
                tracing::warn!(
                    generation,
                    previous_generation = old,
                    "cluster gossip restarted as a new incarnation"
                );
                self.ended = Box::pin(handle.termination_watcher());
                // Dropping the old handle drops the last reference to its state.
                self.handle = handle;
                self.started = Instant::now();
                self.retry_at = None;
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                self.shared.gossip_running(generation);
                true
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), retry_in_ms = self.backoff.as_millis(), "cluster gossip: restart failed");
                self.set_down(format!("{e:#}"));
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                self.retry_at = Some(Instant::now() + self.backoff);
                false
            }
        }
    }

    fn set_down(&self, error: String) {
        drop(self.shared.gossip_restarting(error));
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::HashSet,
        net::SocketAddr,
        sync::atomic::{AtomicUsize, Ordering::SeqCst},
    };

    use async_trait::async_trait;
    use chitchat::{
        transport::{RecvOutcome, SendOutcome, Socket, UdpTransport},
        ChitchatEnvelope, ChitchatId, FailureDetectorConfig, ProtocolVersion,
    };
    use tokio::sync::Notify;

    use super::*;

    /// UDP, except that `fail_opens` opens fail and `break_socket` ends the open socket's
    /// `recv` with an error, as EMFILE or a closed descriptor would.
    #[derive(Clone, Default)]
    struct Flaky {
        fail_opens: Arc<AtomicUsize>,
        break_socket: Arc<Notify>,
    }

    struct FlakySocket {
        inner: Box<dyn Socket>,
        broken: Arc<Notify>,
    }

    #[async_trait]
    impl Transport for Flaky {
        async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
            if self
                .fail_opens
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                anyhow::bail!("Too many open files (os error 24) (test)");
            }
            Ok(Box::new(FlakySocket {
                inner: UdpTransport.open(listen_addr).await?,
                broken: self.break_socket.clone(),
            }))
        }
    }

    #[async_trait]
    impl Socket for FlakySocket {
        fn local_addr(&self) -> anyhow::Result<SocketAddr> {
            self.inner.local_addr()
        }
        async fn send(
            &mut self,
            to: SocketAddr,
            envelope: ChitchatEnvelope,
        ) -> anyhow::Result<SendOutcome> {
            self.inner.send(to, envelope).await
        }
        async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
            tokio::select! {
                r = self.inner.recv() => r,
                () = self.broken.notified() => anyhow::bail!("Too many open files (os error 24) (test)"),
            }
        }
    }

    fn config(
        name: &str,
        addr: SocketAddr,
        seeds: &[SocketAddr],
        generation: u64,
    ) -> ChitchatConfig {
        let interval = Duration::from_millis(50);
        ChitchatConfig {
            chitchat_id: ChitchatId::new(name.to_string(), generation, addr),
            cluster_id: "test".to_string(),
            gossip_interval: interval,
            listen_addr: addr,
            seed_nodes: seeds.iter().map(ToString::to_string).collect(),
            failure_detector_config: FailureDetectorConfig {
                initial_interval: interval,
                ..FailureDetectorConfig::default()
            },
            marked_for_deletion_grace_period: Duration::from_secs(60),
            catchup_callback: None,
            extra_liveness_predicate: None,
            protocol_version: ProtocolVersion::V1,
        }
    }

    fn free_addr() -> SocketAddr {
        std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    async fn live(handle: &ChitchatHandle) -> HashSet<ChitchatId> {
        handle
            .with_chitchat(|c| c.live_nodes().cloned().collect())
            .await
    }

    /// Waits (up to 10 s) until `b` sees `a`'s current incarnation live and `a` sees `b`,
    /// supervising `a` meanwhile.
    async fn until_mutually_live(a: &mut Gossip, b: &ChitchatHandle) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            a.supervise().await;
            let a_id = a.handle().chitchat_id().clone();
            if a.running()
                && live(b).await.contains(&a_id)
                && live(a.handle()).await.contains(b.chitchat_id())
            {
                return;
            }
            assert!(Instant::now() < deadline, "a and b never saw each other");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// chitchat's loop ends on a socket error: the supervisor notices, waits its backoff, retries
    /// an open that fails (EMFILE), then starts a new incarnation with the keys published so
    /// far; the peer sees it live again and it sees the peer. Status and counters say so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gossip_loop_that_dies_is_restarted() {
        let (a_addr, b_addr) = (free_addr(), free_addr());
        let flaky = Flaky::default();
        let shared = Arc::new(Shared::default());
        let mut a = Gossip::spawn(
            1,
            Box::new(move |g| config("a", a_addr, &[b_addr], g)),
            Box::new(flaky.clone()),
            shared.clone(),
            Duration::from_millis(200),
        )
        .await
        .unwrap();
        a.handle()
            .with_chitchat(|c| c.self_node_state().set("c/r/10.0.0.1", "1:2:3"))
            .await;
        let b = spawn_chitchat(config("b", b_addr, &[a_addr], 1), Vec::new(), &UdpTransport)
            .await
            .unwrap();
        until_mutually_live(&mut a, &b).await;
        assert_eq!(shared.counters.gossip_restarts.load(Relaxed), 0);

        // The socket breaks, and the next open fails once.
        flaky.fail_opens.store(1, SeqCst);
        flaky.break_socket.notify_one();
        let down_at = Instant::now();
        while a.supervise().await {
            assert!(
                down_at.elapsed() < Duration::from_secs(5),
                "the end went unnoticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(shared.status().gossip, "restarting");
        assert!(shared
            .status()
            .gossip_error
            .unwrap()
            .contains("os error 24"));
        assert_eq!(
            a.handle().chitchat_id().generation_id,
            1,
            "not restarted before the backoff"
        );

        until_mutually_live(&mut a, &b).await;
        let waited = down_at.elapsed();
        // 200 ms, then the failed open, then 400 ms more.
        assert!(
            waited >= Duration::from_millis(600),
            "backoff not respected: {waited:?}"
        );
        let status = shared.status();
        assert_eq!(status.gossip, "running");
        assert_eq!(status.gossip_error, None);
        assert_eq!(
            status.counters.gossip_restarts, 2,
            "a failed attempt and a successful one"
        );
        let generation = a.handle().chitchat_id().generation_id;
        assert!(generation > 1);
        assert_eq!(status.generation, generation);
        // The published keys came along, and b holds them under the new incarnation.
        let new_id = a.handle().chitchat_id().clone();
        let deadline = Instant::now() + Duration::from_secs(10);
        while b
            .with_chitchat(|c| {
                c.node_state(&new_id)
                    .and_then(|s| s.get("c/r/10.0.0.1").map(str::to_string))
            })
            .await
            .as_deref()
            != Some("1:2:3")
        {
            assert!(Instant::now() < deadline, "the carried key never reached b");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A socket that cannot be opened at start (the address is taken) does not fail the start:
    /// gossip starts down, shown `restarting` with the error, and comes up once an open works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gossip_socket_that_cannot_be_opened_at_start_is_retried() {
        let (a_addr, b_addr) = (free_addr(), free_addr());
        let flaky = Flaky::default();
        flaky.fail_opens.store(2, SeqCst);
        let shared = Arc::new(Shared::default());
        let mut a = Gossip::spawn(
            1,
            Box::new(move |g| config("a", a_addr, &[b_addr], g)),
            Box::new(flaky.clone()),
            shared.clone(),
            Duration::from_millis(100),
        )
        .await
        .expect("the start must not fail when the socket cannot be opened");
        assert!(!a.running());
        let status = shared.status();
        assert_eq!(status.gossip, "restarting");
        assert!(status.gossip_error.unwrap().contains("os error 24"));
        let b = spawn_chitchat(config("b", b_addr, &[a_addr], 1), Vec::new(), &UdpTransport)
            .await
            .unwrap();
        until_mutually_live(&mut a, &b).await;
        let status = shared.status();
        assert_eq!(status.gossip, "running");
        assert_eq!(status.gossip_error, None);
        assert_eq!(
            status.counters.gossip_restarts, 2,
            "a failed attempt and a successful one"
        );
    }
}
