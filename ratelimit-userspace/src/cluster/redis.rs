//! The Redis store of `[cluster] backend = "redis"`: the demand exchange.
//!
//! Every round each agent runs, for each key it holds (a bucket of a cluster-scoped limit with a
//! demand figure, at most `max_keys`), one server-side script on that key's hash,
//! `{rl:CLUSTER:RULE:LIMIT:ADDR}` (the whole name is the hash tag, so a key's state lives on one
//! shard of a Redis Cluster): it writes this host's field (`NODE_ID` -> `MS:GENERATION:DEMAND`,
//! `MS` the server's clock), drops the fields older than the stale limit, renews the key's
//! expiry and returns the other holders' fields. One more script keeps the membership set,
//! `{rl:CLUSTER}:members` (node ids scored by the server's time they were last seen). The calls
//! of a round go out together on one multiplexed connection (pipelined: one round trip per
//! round, whatever the number of keys), so a host's traffic and state are its own keys only,
//! not hosts x keys as with gossip.
//!
//! What comes back is checked before it counts (a field that does not parse, a node id too long,
//! a demand negative, not finite or beyond [`MAX_DEMAND`] is left out and counted): whoever can
//! write to the store can claim any demand, as a peer with the gossip key can.
//!
//! A round that cannot reach the store (connection refused, a timeout, an error reply) fails:
//! the connection is dropped and made again at the next round, then after 1 s, doubling up to
//! [`MAX_BACKOFF`] (5 s) while connecting fails, and meanwhile the peers' figures read before go
//! stale as a silent gossip peer's do (fail open). Each connection attempt reads the password
//! file again: a wrong password is fixed by writing the right one, no restart.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use redis::Script;

use crate::config::RedisConfig;

/// The largest demand a field may carry, packets/s (the largest rate is 10^9): more is refused.
pub const MAX_DEMAND: f64 = 1e12;
/// Most fields of other holders one key's script returns one by one (the counted peers' cap);
/// the holders beyond come back summed (see [`KEY_SCRIPT`]), so the budget is divided between
/// every holder, however many.
pub const MAX_FIELDS: usize = super::sync::MAX_PEERS;
/// Most members read from the membership set.
const MAX_MEMBERS: usize = 256;
/// Calls sent together before waiting for their replies (bounds the memory of one batch).
const BATCH: usize = 1024;
/// The first wait before reconnecting, doubled while attempts fail.
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait before reconnecting: a store that comes back is used again within this
/// (and a round), while a dead one costs an attempt (at most the connect timeout) this often.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Writes this host's field of a key, drops stale fields, returns the server's time, then the
/// holders beyond the first ARGV[6] (how many, their demands' sum, the newest write's time: the
/// demands that are numbers in 0..=ARGV[7], as [`parse_field`] would read them), then the
/// other fields one by one (at most ARGV[6] of them). Numbers go back as text: Redis would cut
/// a Lua number to an integer.
const KEY_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
redis.call('HSET', KEYS[1], me, now .. ':' .. ARGV[2] .. ':' .. ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
local stale = tonumber(ARGV[4])
local most = tonumber(ARGV[6])
local max_demand = tonumber(ARGV[7])
local fields = {}
local rest_n, rest_sum, rest_at = 0, 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local f, v = all[i], all[i + 1]
  if f ~= me then
    local at = tonumber(string.match(v, '^(%d+):'))
    if at == nil or now - at > stale then
      redis.call('HDEL', KEYS[1], f)
    elseif #fields < 2 * most then
      fields[#fields + 1] = f
      fields[#fields + 1] = v
    else
      local d = tonumber(string.match(v, '^%d+:%d+:([0-9.eE+-]+)$'))
      if d ~= nil and d >= 0 and d <= max_demand then
        rest_n = rest_n + 1
        rest_sum = rest_sum + d
        if at > rest_at then rest_at = at end
      end
    end
  end
end
local out = { tostring(now), tostring(rest_n), string.format('%.3f', rest_sum), tostring(rest_at) }
for i = 1, #fields do out[#out + 1] = fields[i] end
return out
";

/// Marks this host seen in the membership set, drops members not seen for ARGV[2] ms, returns
/// the server's time and the members (at most ARGV[3]) with when each was last seen.
const MEMBERS_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
local out = { tostring(now) }
local m = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
for i = 1, #m do out[#out + 1] = m[i] end
return out
";

/// One key this host writes in a round: its hash's name and this host's demand (packets/s).
#[derive(Clone, Debug)]
pub struct Entry {
    /// The key's hash in the store ([`key_name`]).
    pub key: String,
    /// This host's demand for it.
    pub demand: f64,
}

/// Another holder's field of a key, as read.
#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    /// Its node id.
    pub node: String,
    /// Its incarnation.
    pub generation: u64,
    /// Its demand, packets/s.
    pub demand: f64,
    /// How old the field was when read, by the server's clock, ms.
    pub age_ms: u64,
    /// Holders it stands for: 1, or for the holders beyond [`MAX_FIELDS`] their number (its
    /// demand their sum, its age the newest one's; see [`REST_NODE`]).
    pub holders: u32,
}

/// The node id the holders beyond [`MAX_FIELDS`] are shown under (no agent's: those end with
/// `/ADDRESS`).
pub const REST_NODE: &str = "(more holders)";

/// What one round read from the store.
#[derive(Debug, Default)]
pub struct Exchanged {
    /// Per key written (by index in the round's entries), the other holders' fields.
    pub fields: Vec<Vec<Field>>,
    /// The members seen lately (not this host) and how long ago, ms.
    pub members: Vec<(String, u64)>,
    /// The server's time, Unix ms.
    pub server_ms: u64,
    /// Fields or members left out as unreadable or impossible.
    pub refused: u64,
    /// The round trip, ms.
    pub rtt_ms: f64,
}

/// The connection: to one server, or to a Redis Cluster.
#[derive(Clone)]
enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Conn {
    async fn invoke(
        &mut self,
        call: &redis::ScriptInvocation<'_>,
    ) -> redis::RedisResult<Vec<Vec<u8>>> {
        match self {
            Self::Single(c) => call.invoke_async(c).await,
            Self::Cluster(c) => call.invoke_async(c).await,
        }
    }
}

/// The store's client: its connection (made again after a failure), the scripts and the names
/// of this cluster's keys.
pub struct RedisStore {
    config: RedisConfig,
    password: Option<String>,
    cluster_id: String,
    node: String,
    generation: u64,
    conn: Option<Conn>,
    next_attempt: Option<Instant>,
    backoff: Duration,
    /// The last error, shown again while waiting to reconnect.
    last_error: String,
    key_script: Script,
    members_script: Script,
    /// `standalone` or `cluster` once connected, and the shards of a cluster.
    pub mode: &'static str,
    /// The shards a Redis Cluster reported.
    pub shards: Option<u64>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("urls", &self.config.urls)
            .field("node", &self.node)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// The hash of key `addr` of limit `limit` of rule `rule` in cluster `cluster_id`: the whole
/// name is the hash tag (one slot). Rule names and cluster ids hold no `{`, `}` or `:`.
#[must_use]
pub fn key_name(cluster_id: &str, rule: &str, limit: u8, addr: std::net::IpAddr) -> String {
    format!("{{rl:{cluster_id}:{rule}:{limit}:{addr}}}")
}

/// The membership set of cluster `cluster_id`.
#[must_use]
pub fn members_name(cluster_id: &str) -> String {
    format!("{{rl:{cluster_id}}}:members")
}

impl RedisStore {
    /// A client for `config` (not connected yet), as node `node` of incarnation `generation`;
    /// the password is read (and checked) now, and again at each connection attempt.
    pub fn new(
        config: &RedisConfig,
        cluster_id: &str,
        node: String,
        generation: u64,
    ) -> Result<Self, String> {
        let password = config
            .password_file
            .as_deref()
            .map(crate::config::read_redis_password)
            .transpose()
            .map_err(|e| format!("[cluster] redis_password_file: {e}"))?;
        // rustls needs a process-wide crypto provider for rediss:// (another may be there).
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(Self {
            config: config.clone(),
            password,
            cluster_id: cluster_id.to_string(),
            node,
            generation,
            conn: None,
            next_attempt: None,
            backoff: MIN_BACKOFF,
            last_error: String::new(),
            key_script: Script::new(KEY_SCRIPT),
            members_script: Script::new(MEMBERS_SCRIPT),
            mode: "unknown",
            shards: None,
        })
    }

    /// Whether a connection is held now.
    #[must_use]
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    fn connection_info(&self, url: &str) -> redis::RedisResult<redis::ConnectionInfo> {
        use redis::IntoConnectionInfo as _;
        let info = url.into_connection_info()?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &self.config.user {
            settings = settings.set_username(u);
        }
        if let Some(p) = &self.password {
            settings = settings.set_password(p);
        }
        Ok(info.set_redis_settings(settings))
    }

    /// Connects: to the first URL that answers, and if that server runs in cluster mode, to the
    /// Redis Cluster the URLs seed. The password file is read again first (with the same
    /// checks), so that a wrong or rotated password is fixed by writing the file: the agent
    /// logs in with it at its next attempt, with no restart.
    async fn connect(&mut self) -> Result<Conn, String> {
        if let Some(path) = &self.config.password_file {
            self.password = Some(
                crate::config::read_redis_password(path)
                    .map_err(|e| format!("[cluster] redis_password_file: {e}"))?,
            );
        }
        // Read again at each attempt too: a renewed CA is used with no restart.
        let certs = match &self.config.ca_file {
            None => None,
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(
                    crate::config::read_redis_ca(path)
                        .map_err(|e| format!("[cluster] redis_ca_file: {e}"))?,
                ),
            }),
        };
        let connect = Duration::from_millis(self.config.connect_timeout_ms);
        let command = Duration::from_millis(self.config.command_timeout_ms);
        let conf = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect))
            .set_response_timeout(Some(command));
        let mut last = String::from("no URL");
        for url in &self.config.urls {
            let attempt = async {
                let info = self.connection_info(url)?;
                let client = match &certs {
                    None => redis::Client::open(info)?,
                    Some(c) => redis::Client::build_with_tls(info, c.clone())?,
                };
                let mut c = client
                    .get_multiplexed_async_connection_with_config(&conf)
                    .await?;
                let info: String = redis::cmd("INFO")
                    .arg("cluster")
                    .query_async(&mut c)
                    .await?;
                redis::RedisResult::Ok((c, info.contains("cluster_enabled:1")))
            };
            match tokio::time::timeout(connect + command, attempt).await {
                Ok(Ok((c, false))) => {
                    self.mode = "standalone";
                    self.shards = None;
                    return Ok(Conn::Single(c));
                }
                Ok(Ok((mut c, true))) => {
                    let info: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut c)
                        .await
                        .unwrap_or_default();
                    self.shards = info
                        .lines()
                        .find_map(|l| l.strip_prefix("cluster_size:"))
                        .and_then(|n| n.trim().parse().ok());
                    let infos = self
                        .config
                        .urls
                        .iter()
                        .map(|u| self.connection_info(u))
                        .collect::<redis::RedisResult<Vec<_>>>()
                        .map_err(|e| e.to_string())?;
                    let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                        .connection_timeout(connect)
                        .response_timeout(command)
                        .retries(0);
                    if let Some(c) = &certs {
                        builder = builder.certs(c.clone());
                    }
                    let client = builder
                        .build()
                        .map_err(|e| format!("the Redis Cluster: {e}"))?;
                    let c = tokio::time::timeout(connect + command, client.get_async_connection())
                        .await
                        .map_err(|_| format!("the Redis Cluster: no answer within {connect:?}"))?
                        .map_err(|e| format!("the Redis Cluster: {e}"))?;
                    self.mode = "cluster";
                    return Ok(Conn::Cluster(c));
                }
                Ok(Err(e)) => last = format!("{url}: {e}"),
                Err(_) => last = format!("{url}: no answer within {:?}", connect + command),
            }
        }
        Err(last)
    }

    /// One round's exchange: writes `entries` (this host's demand for each key it holds) and
    /// reads the other holders' fields of the same keys and the membership set. Fields older
    /// than `stale_ms` (by the server's clock) are dropped from the store and not returned;
    /// a key not written for `ttl_ms` expires. `Err` (the connection is dropped; it is made
    /// again after a backoff) if the store cannot be reached or answers with an error.
    pub async fn exchange(
        &mut self,
        entries: &[Entry],
        stale_ms: u64,
        ttl_ms: u64,
    ) -> Result<Exchanged, String> {
        let fresh = self.conn.is_none();
        if fresh {
            if self.next_attempt.is_some_and(|t| Instant::now() < t) {
                // The error that made it wait stays the one shown.
                return Err(self.last_error.clone());
            }
            match self.connect().await {
                Ok(c) => {
                    self.conn = Some(c);
                    self.next_attempt = None;
                }
                Err(e) => {
                    self.next_attempt = Some(Instant::now() + self.backoff);
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    self.last_error = format!("connecting: {e}");
                    return Err(self.last_error.clone());
                }
            }
        }
        let Some(conn) = self.conn.clone() else {
            return Err("not connected".into());
        };
        let command = Duration::from_millis(self.config.command_timeout_ms);
        let began = Instant::now();
        let result = tokio::time::timeout(command, self.calls(conn, entries, stale_ms, ttl_ms))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {command:?}")));
        match result {
            Ok(mut x) => {
                x.rtt_ms = began.elapsed().as_secs_f64() * 1000.0;
                self.backoff = MIN_BACKOFF;
                Ok(x)
            }
            Err(e) => {
                // Connected again at the next round (a restarted store is used at once), unless
                // this connection was new (a store that refuses the calls: not every round).
                self.conn = None;
                self.last_error.clone_from(&e);
                if fresh {
                    self.next_attempt = Some(Instant::now() + self.backoff);
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                } else {
                    self.next_attempt = None;
                }
                Err(e)
            }
        }
    }

    async fn calls(
        &self,
        conn: Conn,
        entries: &[Entry],
        stale_ms: u64,
        ttl_ms: u64,
    ) -> Result<Exchanged, String> {
        let members_key = members_name(&self.cluster_id);
        let member = {
            let conn = conn.clone();
            let mut call = self.members_script.key(&members_key);
            call.arg(&self.node).arg(stale_ms).arg(MAX_MEMBERS);
            async move {
                let mut conn = conn;
                conn.invoke(&call).await
            }
        };
        let mut x = Exchanged::default();
        let members = member.await.map_err(|e| e.to_string())?;
        let (server_ms, members) =
            split_now(members).ok_or("the membership script answered nothing")?;
        x.server_ms = server_ms;
        for pair in members.chunks(2) {
            match pair {
                [m, score] => match (std::str::from_utf8(m), parse_u64(score)) {
                    (Ok(m), Some(at)) if valid_node(m) => {
                        if m != self.node {
                            x.members
                                .push((m.to_string(), server_ms.saturating_sub(at)));
                        }
                    }
                    _ => x.refused += 1,
                },
                _ => x.refused += 1,
            }
        }
        x.fields = Vec::with_capacity(entries.len());
        for batch in entries.chunks(BATCH) {
            let calls = batch.iter().map(|e| {
                let mut conn = conn.clone();
                let mut call = self.key_script.key(&e.key);
                call.arg(&self.node)
                    .arg(self.generation)
                    .arg(format!("{:.3}", e.demand.clamp(0.0, MAX_DEMAND)))
                    .arg(stale_ms)
                    .arg(ttl_ms)
                    .arg(MAX_FIELDS)
                    .arg(MAX_DEMAND);
                async move { conn.invoke(&call).await }
            });
            for reply in futures_util::future::join_all(calls).await {
                let reply = reply.map_err(|e| e.to_string())?;
                let Some((now, mut rest)) = split_now(reply) else {
                    x.refused += 1;
                    x.fields.push(Vec::new());
                    continue;
                };
                if rest.len() < 3 {
                    x.refused += 1;
                    x.fields.push(Vec::new());
                    continue;
                }
                let others = rest.split_off(3);
                let mut fields = Vec::new();
                match parse_rest(&rest, now) {
                    Ok(Some(f)) => fields.push(f),
                    Ok(None) => {}
                    Err(()) => x.refused += 1,
                }
                let rest = others;
                for pair in rest.chunks(2) {
                    match pair {
                        [f, v] => match parse_field(f, v, now) {
                            Some(f) if f.node != self.node => fields.push(f),
                            Some(_) => {}
                            None => x.refused += 1,
                        },
                        _ => x.refused += 1,
                    }
                }
                x.fields.push(fields);
            }
        }
        Ok(x)
    }
}

/// The server's time a script put first, and the rest.
fn split_now(mut reply: Vec<Vec<u8>>) -> Option<(u64, Vec<Vec<u8>>)> {
    if reply.is_empty() {
        return None;
    }
    let rest = reply.split_off(1);
    Some((parse_u64(&reply[0])?, rest))
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(b).ok()?;
    // A score comes back as a float's text ("1732800000000" or "1.7328e12").
    s.parse::<u64>().ok().or_else(|| {
        let f = s.parse::<f64>().ok()?;
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "checked finite, non-negative and below 2^53"
        )]
        let n = (f.is_finite() && (0.0..9.0e15).contains(&f)).then_some(f as u64);
        n
    })
}

/// A node id as an agent writes it: 1 to [`MAX_NODE_ID_LEN`] bytes of printable text.
///
/// [`MAX_NODE_ID_LEN`]: super::inspect::MAX_NODE_ID_LEN
fn valid_node(node: &str) -> bool {
    !node.is_empty()
        && node.len() <= super::inspect::MAX_NODE_ID_LEN
        && !node.chars().any(char::is_control)
}

/// A holder's field `node` -> `MS:GENERATION:DEMAND`, read at server time `now`: `None` if it
/// does not parse or carries an impossible demand (negative, not finite, above
/// [`MAX_DEMAND`]).
#[must_use]
pub fn parse_field(node: &[u8], value: &[u8], now: u64) -> Option<Field> {
    let node = std::str::from_utf8(node).ok()?;
    if !valid_node(node) {
        return None;
    }
    let value = std::str::from_utf8(value).ok()?;
    let mut it = value.splitn(3, ':');
    let at: u64 = it.next()?.parse().ok()?;
    let generation: u64 = it.next()?.parse().ok()?;
    let demand: f64 = it.next()?.parse().ok()?;
    if !possible(demand, MAX_DEMAND) {
        return None;
    }
    Some(Field {
        node: node.to_string(),
        generation,
        demand,
        age_ms: now.saturating_sub(at),
        holders: 1,
    })
}

/// Whether a demand read from the store is one a host can have: finite, 0 to `most`.
fn possible(demand: f64, most: f64) -> bool {
    demand.is_finite() && (0.0..=most).contains(&demand)
}

/// The holders beyond [`MAX_FIELDS`] as the key's script sums them (`[count, sum, newest
/// write]`), read at server time `now`, as one [`Field`] of [`REST_NODE`]: `None` for none,
/// `Err` for what does not parse or claims the impossible (a sum above `count x MAX_DEMAND`).
fn parse_rest(rest: &[Vec<u8>], now: u64) -> Result<Option<Field>, ()> {
    let [n, sum, at] = rest else {
        return Err(());
    };
    let n = parse_u64(n).ok_or(())?;
    let at = parse_u64(at).ok_or(())?;
    let sum: f64 = std::str::from_utf8(sum)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(())?;
    if n == 0 {
        return Ok(None);
    }
    let holders = u32::try_from(n).map_err(|_| ())?;
    #[expect(clippy::cast_precision_loss, reason = "a count of holders")]
    let most = n as f64 * MAX_DEMAND;
    if !possible(sum, most) {
        return Err(());
    }
    Ok(Some(Field {
        node: REST_NODE.to_string(),
        generation: 0,
        demand: sum,
        age_ms: now.saturating_sub(at),
        holders,
    }))
}

/// The store's fields of the keys this host holds, by key, as last read (the round keeps them
/// while the store cannot be reached, until they are stale).
pub type Readings = HashMap<String, Vec<Field>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holders_beyond_the_fields_come_back_summed_and_checked() {
        let b = |s: &str| s.as_bytes().to_vec();
        assert_eq!(parse_rest(&[b("0"), b("0.000"), b("0")], 1000), Ok(None));
        let f = parse_rest(&[b("6"), b("1500.500"), b("900")], 1000)
            .unwrap()
            .unwrap();
        assert_eq!(
            (f.node.as_str(), f.holders, f.demand, f.age_ms),
            (REST_NODE, 6, 1500.5, 100)
        );
        for bad in [
            [b("x"), b("1"), b("1")],
            [b("1"), b("nan"), b("1")],
            [b("1"), b("-1"), b("1")],
            [b("1"), b("2e12"), b("1")],
            [b("1"), b("1"), b("")],
        ] {
            assert_eq!(parse_rest(&bad, 1000), Err(()), "{bad:?}");
        }
        assert_eq!(parse_rest(&[b("1"), b("1")], 1000), Err(()), "two parts");
    }

    #[test]
    fn fields_that_do_not_parse_or_claim_the_impossible_are_refused() {
        let ok = parse_field(b"h/198.18.1.2", b"1000:7:250.5", 1100).unwrap();
        assert_eq!(
            ok,
            Field {
                node: "h/198.18.1.2".into(),
                generation: 7,
                demand: 250.5,
                age_ms: 100,
                holders: 1
            }
        );
        // A field from the future (another clock) is not older than 0.
        assert_eq!(parse_field(b"h", b"2000:1:0", 1000).unwrap().age_ms, 0);
        for bad in [
            &b"1000:7:-1"[..],
            b"1000:7:NaN",
            b"1000:7:inf",
            b"1000:7:1e13",
            b"1000:7",
            b"x:7:1",
            b"1000:-7:1",
            b"",
            b"\xff:1:1",
        ] {
            assert_eq!(parse_field(b"h", bad, 1000), None, "{bad:?}");
        }
        assert_eq!(parse_field(b"", b"1000:7:1", 1000), None);
        assert_eq!(parse_field(&[b'x'; 129], b"1000:7:1", 1000), None);
        assert_eq!(parse_field(b"a\nb", b"1000:7:1", 1000), None);
    }

    #[test]
    fn a_keys_state_lives_under_one_hash_tag() {
        let k = key_name("prod", "web", 1, "198.18.0.7".parse().unwrap());
        assert_eq!(k, "{rl:prod:web:1:198.18.0.7}");
        let v6 = key_name("prod", "web", 0, "2001:db8::1".parse().unwrap());
        assert!(
            v6.starts_with('{')
                && v6.ends_with('}')
                && v6[1..v6.len() - 1].find(['{', '}']).is_none()
        );
        assert_eq!(members_name("prod"), "{rl:prod}:members");
        assert_eq!(parse_u64(b"1732800000000"), Some(1_732_800_000_000));
        assert_eq!(parse_u64(b"1.7328e12"), Some(1_732_800_000_000));
        assert_eq!(parse_u64(b"-1"), None);
    }
}
