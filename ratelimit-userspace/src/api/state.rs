//! [`ApiState`], the agent's [`Backend`]: each operation done on the agent, the lock-free read
//! side or the cluster sync. Its own room because it is the one place the API touches the agent;
//! the handlers and the tests see only [`Backend`].

use std::{net::IpAddr, sync::Arc, time::Duration};

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::{error::to_json, top, ApiError, Backend};
use crate::{
    agent::{AgentError, SharedAgent, Status},
    census::ReadSide,
    cluster::{ClusterHandle, ClusterStatus},
    config::RuleConfig,
    learn::{suggest::Query, LearnHandle},
    metrics::{EndpointStatus, MetricsHandle},
};

/// What the API serves: the agent, what is read without its lock, and the cluster sync's handle
/// when the agent is in a cluster.
#[derive(Clone)]
pub struct ApiState {
    /// The agent.
    pub agent: SharedAgent,
    /// The pinned maps, the bucket census and the rules in force, read without the agent's lock
    /// (`status`'s bucket count, `stats`, `top`).
    pub read: ReadSide,
    /// The cluster sync (`None` without `[cluster]`).
    pub cluster: Option<ClusterHandle>,
    /// The metrics endpoint's health (`None` without `[agent] metrics`).
    pub metrics: Option<MetricsHandle>,
    /// One `top` at a time.
    pub top_turn: Arc<Semaphore>,
    /// What was learned of the traffic (`None`: not learning).
    pub learn: Option<LearnHandle>,
}

impl ApiState {
    /// The state for `agent`, `read` and `cluster`.
    #[must_use]
    pub fn new(agent: SharedAgent, read: ReadSide, cluster: Option<ClusterHandle>) -> Self {
        Self {
            agent,
            read,
            cluster,
            metrics: None,
            top_turn: Arc::new(Semaphore::new(1)),
            learn: None,
        }
    }

    /// With the metrics endpoint's health, for `status`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Option<MetricsHandle>) -> Self {
        self.metrics = metrics;
        self
    }

    /// With the learner, for `suggest` (`None`: not learning, `[agent] learn = false`).
    #[must_use]
    pub fn with_learner(mut self, learn: Option<LearnHandle>) -> Self {
        self.learn = learn;
        self
    }
}

impl Backend for ApiState {
    async fn status(&self) -> Result<Value, ApiError> {
        // The bucket count first, without the lock: the lock is then held for a few system calls.
        let census = self.read.census.fresh().await;
        let agent = self.agent.lock().await.status(&census)?;
        to_json(&StatusAnswer {
            agent,
            metrics: self.metrics.as_ref().map(MetricsHandle::status),
            cluster: self.cluster.as_ref().map(ClusterHandle::status),
        })
    }

    async fn rules(&self) -> Result<Value, ApiError> {
        let guard = self.agent.lock().await;
        to_json(&json!({ "rules": guard.config().rules }))
    }

    async fn add_rule(&self, rule: RuleConfig, force: bool) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        tokio::task::block_in_place(|| guard.add_rule(rule.clone(), force))?;
        let added = guard
            .config()
            .rules
            .iter()
            .find(|r| r.name == rule.name)
            .unwrap_or(&rule);
        tracing::info!(rule = %rule.name, "rule added (API)");
        Ok(json!({ "added": added, "rules": guard.config().rules.len() }))
    }

    async fn remove_rule(&self, name: String, force: bool) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        tokio::task::block_in_place(|| guard.remove_rule(&name, force))?;
        tracing::info!(rule = %name, "rule removed (API)");
        Ok(json!({ "removed": name, "rules": guard.config().rules.len() }))
    }

    async fn reload(&self) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        // These read the config file (and its lists): off the runtime's worker threads.
        tokio::task::block_in_place(|| guard.reload())?;
        Ok(json!({
            "reloaded": true,
            "rules": guard.config().rules.len(),
            "restart_needed": guard.reload_state().restart_needed,
        }))
    }

    async fn stats(&self) -> Result<Value, ApiError> {
        let census = self.read.census.fresh().await;
        let read = self.read.clone();
        let report = tokio::task::spawn_blocking(move || read.stats(&census))
            .await
            .map_err(|e| AgentError::Runtime(format!("stats: {e}")))?
            .map_err(AgentError::from)?;
        let mut value = serde_json::to_value(&report).map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })?;
        // The cluster sync's counters, when this agent is in a cluster.
        if let Some(cluster) = &self.cluster {
            value["cluster"] = json!(cluster.status().counters);
        }
        Ok(value)
    }

    async fn cluster(&self) -> Result<Value, ApiError> {
        match &self.cluster {
            Some(cluster) => to_json(&cluster.status()),
            None => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: "this agent is not in a cluster: its config has no [cluster] table".into(),
            }),
        }
    }

    async fn top(
        &self,
        n: usize,
        interval: Duration,
        limit: Option<usize>,
    ) -> Result<Value, ApiError> {
        // Off the agent's lock, one `top` at a time (each keeps up to 16 MiB of baseline).
        let _turn = self
            .top_turn
            .acquire()
            .await
            .map_err(|e| AgentError::Runtime(format!("top: {e}")))?;
        let report = top::measure(
            self.read.maps.clone(),
            self.read.rules.clone(),
            (n, limit),
            interval,
            top::BASELINE_BUDGET,
        )
        .await
        .map_err(AgentError::from)?;
        to_json(&report)
    }

    async fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> Result<Value, ApiError> {
        let answer = self
            .agent
            .lock()
            .await
            .explain(ip, protocol, dst_port, tcp_flags)?;
        to_json(&answer)
    }

    async fn detach(&self, iface: Option<String>) -> Result<Value, ApiError> {
        let done = self.agent.lock().await.detach(iface.as_deref())?;
        Ok(json!({ "detached": done }))
    }

    async fn apply_limit(
        &self,
        rule: String,
        (limit, rate, burst): (usize, u64, u64),
        force: bool,
    ) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        tokio::task::block_in_place(|| guard.set_packet_limit(&rule, (limit, rate, burst), force))?;
        tracing::info!(rule = %rule, limit, rate, burst, "limit set (suggest --apply)");
        Ok(json!({ "applied": { "rule": rule, "limit": limit, "rate": rate, "burst": burst } }))
    }

    async fn suggest(&self, query: Query) -> Result<Value, ApiError> {
        let Some(learn) = self.learn.clone() else {
            return Err(AgentError::Runtime(
                "suggest: the agent is not learning (`learn = false` in [agent])".into(),
            )
            .into());
        };
        let q = query.clone();
        let answer = tokio::task::spawn_blocking(move || learn.suggest(&q))
            .await
            .map_err(|e| AgentError::Runtime(format!("suggest: {e}")))?;
        match answer {
            Ok(suggestions) => Ok(json!({
                "since_secs": query.since_secs,
                "quantile": query.quantile,
                "headroom": query.headroom,
                "suggestions": suggestions,
            })),
            Err(_) => Err(AgentError::NoSuchRule(query.rule.unwrap_or_default()).into()),
        }
    }
}

/// `status` as the API answers it: the agent's, and the cluster's when in one.
#[derive(Serialize)]
struct StatusAnswer {
    #[serde(flatten)]
    agent: Status,
    /// The metrics endpoint's health, when `[agent] metrics` is set: `serving`, or `unbound`
    /// (its address could not be bound; retried in the background) with the error.
    metrics: Option<EndpointStatus>,
    /// Cluster members and counters, when `[cluster]` is set.
    cluster: Option<ClusterStatus>,
}
