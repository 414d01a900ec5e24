//! Checks every authentic chitchat message before chitchat sees it, for what a member with the
//! key (compromised or buggy) could send to crash or corrupt chitchat here.
//!
//! chitchat 0.13 trusts what its peers send: a delta whose `SetMaxVersion` follows a key of a
//! higher version trips an assertion where the delta is applied (its gossip loop panics: each
//! such datagram stops gossip here until the loop is restarted); a delta about this host's own
//! node at a version near `u64::MAX` leaves its own max version there, so the next key this host
//! sets overflows or trips another assertion (the sync loop dies); and a key version or
//! heartbeat far ahead of anything real freezes the node it names (real updates look old for
//! ever). chitchat's own decoding is private to it, so this decodes the wire format again
//! (chitchat's public [`Deserializable`] impls for the primitives, zstd for its compressed
//! blocks), and [`check`] refuses, before chitchat applies anything, a message that:
//! - carries a delta about this host's own node (an honest peer never has a newer version of it
//!   than this host, so never sends one);
//! - sets a node's max version below a key version of the same node delta;
//! - names a version at or above [`MAX_VERSION`] or a heartbeat at or above [`MAX_HEARTBEAT`]
//!   (an honest member gets nowhere near: versions grow by the keys it changes, heartbeats by one
//!   per gossip round);
//! - names a node id longer than [`MAX_NODE_ID_LEN`] bytes (an agent's own is its hostname, at
//!   most 64 bytes, a `/` and its gossip address, at most 58: a Syn naming a few ids of 60 KB
//!   each made this host's own digest too large for a datagram, cutting it off from the cluster
//!   until chitchat forgot them, 5 minutes later);
//! - cannot be decoded, or decompresses to more than [`MAX_DECOMPRESSED`] bytes.
//!
//! chitchat also creates a node state for every id a digest names, which stays in its own digest
//! for 5 minutes and in its memory for 10: ids merely named, however short, would grow this
//! host's memory, its per-round work and its digest without bound. [`Introductions`] admits the
//! ids a digest names within fixed bounds, and [`strip`] removes the others from the digest
//! before chitchat sees it (the rest of the message goes through).
//!
//! A message refused is dropped whole (chitchat never sees it) and counted
//! (`rejected{unsafe}`).

use chitchat::{ChitchatId, Deserializable};

/// Highest version (exclusive) a message may name: 2^56, more than 2 centuries at 10 million
/// key changes a second.
pub const MAX_VERSION: u64 = 1 << 56;
/// Highest heartbeat (exclusive) a digest may name: 2^48, more than 40,000 years at 200 gossip
/// rounds a second.
pub const MAX_HEARTBEAT: u64 = 1 << 48;
/// Most bytes a message's compressed streams may decompress to (16 MiB; chitchat's deltas fit a
/// 64 KiB datagram).
pub const MAX_DECOMPRESSED: usize = 16 << 20;
/// Longest node id (bytes) a message may name: an agent's own is `hostname/gossip address`,
/// at most 64 + 1 + 58 bytes.
pub const MAX_NODE_ID_LEN: usize = 128;

const MAGIC_NUMBER: u16 = 45_139;

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsafe {
    /// Not chitchat's format, as far as this decoder reads it.
    Undecodable,
    /// A delta about this host's own node.
    OwnState,
    /// A node's max version set below a key version of the same node delta.
    MaxVersionBelowKeys,
    /// A version at or above [`MAX_VERSION`].
    VersionTooLarge,
    /// A heartbeat at or above [`MAX_HEARTBEAT`].
    HeartbeatTooLarge,
    /// Another member's heartbeat ahead of what that member itself last reported here, by more
    /// than it can have advanced since ([`Heartbeats`]).
    HeartbeatAhead,
    /// A node id longer than [`MAX_NODE_ID_LEN`].
    NodeIdTooLong,
}

impl Unsafe {
    /// What it means, for the log.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Self::Undecodable => "not a chitchat message this agent can check",
            Self::OwnState => "a delta about this host's own node",
            Self::MaxVersionBelowKeys => "a max version below a key version of the same node",
            Self::VersionTooLarge => "a version no member can have reached",
            Self::HeartbeatTooLarge => "a heartbeat no member can have reached",
            Self::HeartbeatAhead => {
                "another member's heartbeat ahead of what that member itself reported"
            }
            Self::NodeIdTooLong => "a node id longer than any agent's",
        }
    }
}

type R<T> = Result<T, Unsafe>;

fn de<T: Deserializable>(buf: &mut &[u8]) -> R<T> {
    T::deserialize(buf).map_err(|_| Unsafe::Undecodable)
}

fn version(v: u64) -> R<u64> {
    if v >= MAX_VERSION {
        Err(Unsafe::VersionTooLarge)
    } else {
        Ok(v)
    }
}

fn node(buf: &mut &[u8]) -> R<ChitchatId> {
    let id: ChitchatId = de(buf)?;
    if id.node_id.len() > MAX_NODE_ID_LEN {
        return Err(Unsafe::NodeIdTooLong);
    }
    Ok(id)
}

/// chitchat's block stream (`serialize::deserialize_stream`): tagged blocks, zstd-compressed
/// (1) or not (2), up to a 0 tag; returns the bytes they hold.
fn stream(buf: &mut &[u8], total: &mut usize) -> R<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let tag: u8 = de(buf)?;
        if tag == 0 {
            return Ok(out);
        }
        let len = usize::from(de::<u16>(buf)?);
        let block = buf.get(..len).ok_or(Unsafe::Undecodable)?;
        *buf = &buf[len..];
        match tag {
            1 => {
                let plain = zstd::bulk::decompress(block, usize::from(u16::MAX))
                    .map_err(|_| Unsafe::Undecodable)?;
                *total += plain.len();
                out.extend_from_slice(&plain);
            }
            2 => {
                *total += len;
                out.extend_from_slice(block);
            }
            _ => return Err(Unsafe::Undecodable),
        }
        if *total > MAX_DECOMPRESSED {
            return Err(Unsafe::Undecodable);
        }
    }
}

/// One digest entry: `(ChitchatId, heartbeat, last GC version, max version)`.
fn digest_entry(buf: &mut &[u8]) -> R<(ChitchatId, u64)> {
    let id = node(buf)?;
    let heartbeat: u64 = de(buf)?;
    version(de(buf)?)?;
    version(de(buf)?)?;
    if heartbeat >= MAX_HEARTBEAT {
        return Err(Unsafe::HeartbeatTooLarge);
    }
    Ok((id, heartbeat))
}

fn digest(v1: bool, buf: &mut &[u8], total: &mut usize) -> R<Vec<(ChitchatId, u64)>> {
    let mut entries = Vec::new();
    if v1 {
        let bytes = stream(buf, total)?;
        let mut cursor = &bytes[..];
        while !cursor.is_empty() {
            entries.push(digest_entry(&mut cursor)?);
        }
    } else {
        let n: u16 = de(buf)?;
        for _ in 0..n {
            entries.push(digest_entry(buf)?);
        }
    }
    Ok(entries)
}

/// How far beyond this host's own max version another member's view of this host's own state
/// may go before this host takes it as forged: an honest peer never holds more of this host's
/// state than it published (chitchat only relays it), except one version that
/// `trim_peer_states` may add to a state it cannot trim otherwise.
pub const OWN_STATE_AHEAD: u64 = 8;

fn delta(
    buf: &mut &[u8],
    total: &mut usize,
    is_self: &impl Fn(&ChitchatId) -> bool,
    own_max: &mut Option<u64>,
) -> R<()> {
    let bytes = stream(buf, total)?;
    let mut cursor = &bytes[..];
    // The highest version named so far in the current node delta (keys strictly increase,
    // as chitchat's decoder requires; a `SetMaxVersion` sets it).
    let mut max: Option<u64> = None;
    // Whether the current node delta is about this host's own node, and whether any was.
    let (mut in_own, mut own) = (false, false);
    let mut note_own = |in_own: bool, max: Option<u64>| {
        if let (true, Some(m)) = (in_own, max) {
            *own_max = Some(own_max.map_or(m, |o| o.max(m)));
        }
    };
    while !cursor.is_empty() {
        let tag: u8 = de(&mut cursor)?;
        match tag {
            0 => {
                note_own(in_own, max);
                let id = node(&mut cursor)?;
                version(de(&mut cursor)?)?;
                version(de(&mut cursor)?)?;
                in_own = is_self(&id);
                own |= in_own;
                max = Some(0);
            }
            1 => {
                let Some(m) = max else {
                    return Err(Unsafe::Undecodable);
                };
                let _key: String = de(&mut cursor)?;
                let _value: String = de(&mut cursor)?;
                let v = version(de(&mut cursor)?)?;
                let status: u8 = de(&mut cursor)?;
                if status > 2 || v <= m {
                    return Err(Unsafe::Undecodable);
                }
                max = Some(v);
            }
            2 => {
                let Some(m) = max else {
                    return Err(Unsafe::Undecodable);
                };
                let v = version(de(&mut cursor)?)?;
                if v < m {
                    return Err(Unsafe::MaxVersionBelowKeys);
                }
                max = Some(v);
            }
            _ => return Err(Unsafe::Undecodable),
        }
    }
    note_own(in_own, max);
    if own {
        return Err(Unsafe::OwnState);
    }
    Ok(())
}

/// Checks chitchat message `msg` (plaintext, as chitchat's socket receives it); `is_self` tells
/// this host's own node id (its running incarnation). Returns the digest's `(id, heartbeat)`
/// entries, if it has one.
///
/// # Errors
/// Why the message must not reach chitchat (see the module docs).
pub fn check(msg: &[u8], is_self: impl Fn(&ChitchatId) -> bool) -> R<Vec<(ChitchatId, u64)>> {
    check_own(msg, is_self, &mut None)
}

/// [`check`], also telling in `own_max` the highest version a delta about this host's own node
/// names, if the message has one (it is then refused as [`Unsafe::OwnState`]). More than
/// [`OWN_STATE_AHEAD`] beyond this host's own max version: the sender holds this host's state
/// ahead of anything it published, which a member with the key forged (under this host's id,
/// at the sender or before it); chitchat there then takes none of this host's later updates
/// until they pass it (with a version near [`MAX_VERSION`], never), and sends this host its
/// own node in every reply, which this host refuses whole.
///
/// # Errors
/// As [`check`].
pub fn check_own(
    msg: &[u8],
    is_self: impl Fn(&ChitchatId) -> bool,
    own_max: &mut Option<u64>,
) -> R<Vec<(ChitchatId, u64)>> {
    let mut buf = msg;
    let magic: u16 = de(&mut buf)?;
    let protocol: u8 = de(&mut buf)?;
    let kind: u8 = de(&mut buf)?;
    if magic != MAGIC_NUMBER || protocol > 1 {
        return Err(Unsafe::Undecodable);
    }
    let v1 = protocol == 1;
    let mut total = 0usize;
    match kind {
        0 => {
            let d = digest(v1, &mut buf, &mut total)?;
            let _cluster_id: String = de(&mut buf)?;
            Ok(d)
        }
        1 => {
            let d = digest(v1, &mut buf, &mut total)?;
            delta(&mut buf, &mut total, &is_self, own_max)?;
            Ok(d)
        }
        2 => {
            delta(&mut buf, &mut total, &is_self, own_max)?;
            Ok(Vec::new())
        }
        3 => Ok(Vec::new()),
        _ => Err(Unsafe::Undecodable),
    }
}

/// Writes `body` as chitchat's block stream, uncompressed.
#[cfg(test)]
fn block(body: &[u8], out: &mut Vec<u8>) {
    use chitchat::Serializable;
    for chunk in body.chunks(usize::from(u16::MAX)) {
        out.push(2);
        u16::try_from(chunk.len())
            .expect("chunks fit a u16")
            .serialize(out);
        out.extend_from_slice(chunk);
    }
    out.push(0);
}

/// Writes `body` as chitchat's block stream, each block of at most 16 KiB (as chitchat's)
/// zstd-compressed when that makes it smaller: a digest re-encoded by [`strip`] takes no more
/// room than chitchat's own encoding did, which its delta was sized against.
fn compressed_blocks(body: &[u8], out: &mut Vec<u8>) {
    use chitchat::Serializable;
    for chunk in body.chunks(16_384) {
        let (tag, bytes) = match zstd::bulk::compress(chunk, 0) {
            Ok(c) if c.len() < chunk.len() => (1, c),
            _ => (2, chunk.to_vec()),
        };
        out.push(tag);
        u16::try_from(bytes.len())
            .expect("blocks fit a u16")
            .serialize(out);
        out.extend_from_slice(&bytes);
    }
    out.push(0);
}

/// `msg` (which [`check`] accepted) with the digest entries whose id `keep` refuses removed,
/// the rest of the message byte for byte; `msg` itself when it has no digest.
///
/// # Errors
/// [`Unsafe::Undecodable`] if `msg` is not a message [`check`] accepts.
pub fn strip(msg: &[u8], keep: impl Fn(&ChitchatId) -> bool) -> R<Vec<u8>> {
    rewrite(msg, keep, |_| false)
}

/// [`strip`], also writing the heartbeat of the entries whose id `freeze` names as 0: chitchat
/// takes no heartbeat from them (it keeps the highest one heard), so its failure detector stops
/// hearing those members through this message, while the rest of their entry (the versions the
/// sender holds) still tells it what the sender knows.
///
/// # Errors
/// [`Unsafe::Undecodable`] if `msg` is not a message [`check`] accepts.
pub fn rewrite(
    msg: &[u8],
    keep: impl Fn(&ChitchatId) -> bool,
    freeze: impl Fn(&ChitchatId) -> bool,
) -> R<Vec<u8>> {
    use chitchat::Serializable;
    let mut buf = msg;
    let _magic: u16 = de(&mut buf)?;
    let protocol: u8 = de(&mut buf)?;
    let kind: u8 = de(&mut buf)?;
    if kind > 1 {
        return Ok(msg.to_vec());
    }
    let mut out = msg[..4].to_vec();
    let mut kept = Vec::new();
    let mut n = 0u16;
    let mut entries = |cursor: &mut &[u8], count: Option<u16>| -> R<()> {
        let mut i = 0u16;
        while count.map_or(!cursor.is_empty(), |c| i < c) {
            let start = *cursor;
            let (id, _) = digest_entry(cursor)?;
            if keep(&id) {
                let entry = &start[..start.len() - cursor.len()];
                if freeze(&id) {
                    // `id`, then the heartbeat, last GC and max versions (8 bytes each).
                    let hb = entry.len() - 24;
                    kept.extend_from_slice(&entry[..hb]);
                    kept.extend_from_slice(&0u64.to_le_bytes());
                    kept.extend_from_slice(&entry[hb + 8..]);
                } else {
                    kept.extend_from_slice(entry);
                }
                n += 1;
            }
            i += 1;
        }
        Ok(())
    };
    if protocol == 1 {
        let bytes = stream(&mut buf, &mut 0)?;
        entries(&mut &bytes[..], None)?;
        compressed_blocks(&kept, &mut out);
    } else {
        let count: u16 = de(&mut buf)?;
        entries(&mut buf, Some(count))?;
        n.serialize(&mut out);
        out.extend_from_slice(&kept);
    }
    out.extend_from_slice(buf);
    Ok(out)
}

/// Most ids one sender address may have admitted as its own incarnations
/// ([`Introductions`]): an agent restarting a few times within [`FORGET_MS`].
pub const OWN_IDS_PER_IP: usize = 8;
/// Most ids admitted as their senders' own, all addresses together (a member with the key and
/// many addresses, an IPv6 prefix say, must not grow this host's digest past a datagram either):
/// 64 counted peers restarting twice within [`FORGET_MS`], and more.
pub const MAX_OWN_IDS: usize = 160;
/// Most ids other than its own one sender address may have introduced ([`Introductions`]).
pub const INTRODUCED_PER_IP: usize = 64;
/// Most ids introduced by others than themselves, all senders together. With
/// [`MAX_OWN_IDS`] and [`MAX_NODE_ID_LEN`], this host's own digest stays under 47 KB (a
/// datagram holds 65,507 bytes; chitchat panicked answering a Syn when its digest left less
/// than 100 bytes for the delta).
pub const MAX_INTRODUCED: usize = 96;
/// How long an id no digest names any more is remembered: longer than chitchat keeps the node
/// state a digest created (`DEAD_NODE_GRACE`, 10 minutes).
pub const FORGET_MS: u64 = 660_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum By {
    /// Sent an authentic datagram of its own from this address.
    Own(std::net::IpAddr),
    /// First named by a sender at this address.
    Introduced(std::net::IpAddr),
}

/// The ids this host's chitchat was let hear of, and who introduced them. chitchat creates a
/// node state for every id a digest names; [`Introductions::admit`] lets an id through only
/// if it is known already, or is the sender's own id and its address has fewer than
/// [`OWN_IDS_PER_IP`] (and all together fewer than [`MAX_OWN_IDS`]), or its sender's IP
/// address introduced fewer than [`INTRODUCED_PER_IP`] ids still remembered and all senders
/// together fewer than [`MAX_INTRODUCED`]. An id introduced by another that later speaks for
/// itself counts as its own from then on (so an honest cluster's members, introduced by a
/// seed, soon free the seed's quota). An id no admitted digest named for [`FORGET_MS`] is
/// forgotten. A member with the key can so make this host hold at most [`OWN_IDS_PER_IP`] +
/// [`INTRODUCED_PER_IP`] ids per IP address it sends from (at most [`MAX_INTRODUCED`] beyond
/// its own, however relayed); once all of [`MAX_INTRODUCED`] is taken, new members are learnt
/// only when they speak to this host themselves.
#[derive(Debug, Default)]
pub struct Introductions {
    known: std::collections::HashMap<ChitchatId, (By, u64)>,
    own: std::collections::HashMap<std::net::IpAddr, usize>,
    introduced: std::collections::HashMap<std::net::IpAddr, usize>,
    own_total: usize,
    introduced_total: usize,
    swept_ms: u64,
}

impl Introductions {
    fn add(&mut self, by: By, delta: isize) {
        let (map, total, ip) = match by {
            By::Own(ip) => (&mut self.own, &mut self.own_total, ip),
            By::Introduced(ip) => (&mut self.introduced, &mut self.introduced_total, ip),
        };
        let n = map.entry(ip).or_insert(0);
        *n = n.saturating_add_signed(delta);
        *total = total.saturating_add_signed(delta);
        if *n == 0 {
            map.remove(&ip);
        }
    }

    fn own_room(&self, ip: std::net::IpAddr) -> bool {
        self.own_total < MAX_OWN_IDS && self.own.get(&ip).copied().unwrap_or(0) < OWN_IDS_PER_IP
    }

    fn forget_old(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.swept_ms) < 1_000 {
            return;
        }
        self.swept_ms = now_ms;
        let old: Vec<(ChitchatId, By)> = self
            .known
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) > FORGET_MS)
            .map(|(id, (by, _))| (id.clone(), *by))
            .collect();
        for (id, by) in old {
            self.known.remove(&id);
            self.add(by, -1);
        }
    }

    /// Admits the ids of a digest sent from `from` (`is_sender` tells the sender's own id,
    /// `is_self` this host's), at `now_ms` (a monotonic clock); returns the ids refused, to be
    /// stripped from the digest ([`strip`]).
    pub fn admit(
        &mut self,
        entries: &[(ChitchatId, u64)],
        from: std::net::IpAddr,
        is_sender: impl Fn(&ChitchatId) -> bool,
        is_self: impl Fn(&ChitchatId) -> bool,
        now_ms: u64,
    ) -> std::collections::HashSet<ChitchatId> {
        self.forget_old(now_ms);
        let mut refused = std::collections::HashSet::new();
        for (id, _) in entries {
            if is_self(id) {
                continue;
            }
            let sender = is_sender(id);
            if let Some(&(by, _)) = self.known.get(id) {
                let mut by_now = by;
                if sender && matches!(by, By::Introduced(_)) && self.own_room(from) {
                    self.add(by, -1);
                    by_now = By::Own(from);
                    self.add(by_now, 1);
                }
                self.known.insert(id.clone(), (by_now, now_ms));
                continue;
            }
            let by = if sender && self.own_room(from) {
                By::Own(from)
            } else if self.introduced_total < MAX_INTRODUCED
                && self.introduced.get(&from).copied().unwrap_or(0) < INTRODUCED_PER_IP
            {
                By::Introduced(from)
            } else {
                refused.insert(id.clone());
                continue;
            };
            self.add(by, 1);
            self.known.insert(id.clone(), (by, now_ms));
        }
        refused
    }
}

/// A digest may name another member's heartbeat at most this far ahead of what that member itself
/// last reported here, plus [`HEARTBEATS_PER_MS`] per millisecond since.
pub const HEARTBEAT_SLACK: u64 = 1_000;
/// How fast a member's heartbeat may advance, at most, per millisecond (chitchat adds one per
/// gossip round and per message received: about 0.2/ms at the default sync interval, 2/ms at the
/// smallest).
pub const HEARTBEATS_PER_MS: u64 = 4;
/// Most members whose own heartbeat is remembered (the least recently heard forgotten first).
pub const MAX_HEARTBEATS: usize = 1024;

/// Each member's heartbeat as it reported it itself (its own entry in the digest of a datagram
/// it sealed and sent from its address), and when. chitchat keeps the highest heartbeat any
/// digest names for a member; one named far ahead (by a member with the key) makes the real ones
/// look old, so chitchat's failure detector stops hearing that member and, once it is declared
/// dead and collected, never takes it back until its heartbeat catches up. [`Heartbeats::check`]
/// refuses a message naming another member's heartbeat more than [`HEARTBEAT_SLACK`] +
/// [`HEARTBEATS_PER_MS`] x the milliseconds since that member's own report ahead of it; a
/// member not heard directly yet is not judged.
#[derive(Debug, Default)]
pub struct Heartbeats(std::collections::HashMap<ChitchatId, (u64, u64)>);

impl Heartbeats {
    /// Checks the digest `entries` of a message whose sender's own id is the one `is_sender`
    /// tells, received at `now_ms` (a monotonic clock); on success records the sender's own
    /// heartbeat.
    ///
    /// # Errors
    /// [`Unsafe::HeartbeatAhead`] when another member's heartbeat is ahead of its own report.
    pub fn check(
        &mut self,
        entries: &[(ChitchatId, u64)],
        is_sender: impl Fn(&ChitchatId) -> bool,
        now_ms: u64,
    ) -> R<()> {
        for (id, heartbeat) in entries {
            if is_sender(id) {
                continue;
            }
            if let Some(&(own, at)) = self.0.get(id) {
                let allowed = own
                    .saturating_add(HEARTBEAT_SLACK)
                    .saturating_add(now_ms.saturating_sub(at).saturating_mul(HEARTBEATS_PER_MS));
                if *heartbeat > allowed {
                    return Err(Unsafe::HeartbeatAhead);
                }
            }
        }
        for (id, heartbeat) in entries.iter().filter(|(id, _)| is_sender(id)) {
            if self.0.len() >= MAX_HEARTBEATS && !self.0.contains_key(id) {
                if let Some(old) = self
                    .0
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
                {
                    self.0.remove(&old);
                }
            }
            let e = self.0.entry(id.clone()).or_insert((*heartbeat, now_ms));
            if *heartbeat >= e.0 {
                *e = (*heartbeat, now_ms);
            }
        }
        Ok(())
    }
}

/// Writes chitchat messages byte by byte (uncompressed blocks), for the tests: honest ones and
/// the crafted ones a member with the key could send.
#[cfg(test)]
pub mod craft {
    use chitchat::{ChitchatId, Serializable};

    /// One delta operation.
    pub enum Op<'a> {
        /// A node: its id, last GC version, from version (excluded).
        Node(&'a ChitchatId, u64, u64),
        /// A key: name, value, version.
        Kv(&'a str, &'a str, u64),
        /// `SetMaxVersion`.
        SetMax(u64),
    }

    use super::block;

    fn header(kind: u8) -> Vec<u8> {
        let mut out = Vec::new();
        super::MAGIC_NUMBER.serialize(&mut out);
        out.push(1);
        out.push(kind);
        out
    }

    fn digest(entries: &[(&ChitchatId, u64, u64)], out: &mut Vec<u8>) {
        let mut body = Vec::new();
        for (id, heartbeat, max_version) in entries {
            id.serialize(&mut body);
            heartbeat.serialize(&mut body);
            0u64.serialize(&mut body);
            max_version.serialize(&mut body);
        }
        block(&body, out);
    }

    fn delta(ops: &[Op<'_>], out: &mut Vec<u8>) {
        let mut body = Vec::new();
        for op in ops {
            match op {
                Op::Node(id, gc, from) => {
                    body.push(0);
                    id.serialize(&mut body);
                    gc.serialize(&mut body);
                    from.serialize(&mut body);
                }
                Op::Kv(k, v, version) => {
                    body.push(1);
                    k.serialize(&mut body);
                    v.serialize(&mut body);
                    version.serialize(&mut body);
                    body.push(0);
                }
                Op::SetMax(v) => {
                    body.push(2);
                    v.serialize(&mut body);
                }
            }
        }
        block(&body, out);
    }

    /// A Syn (protocol V1) with `entries` (`(id, heartbeat, max version)`).
    #[must_use]
    pub fn syn(entries: &[(&ChitchatId, u64, u64)], cluster_id: &str) -> Vec<u8> {
        let mut out = header(0);
        digest(entries, &mut out);
        cluster_id.serialize(&mut out);
        out
    }

    /// A `SynAck` (protocol V1).
    #[must_use]
    pub fn syn_ack(entries: &[(&ChitchatId, u64, u64)], ops: &[Op<'_>]) -> Vec<u8> {
        let mut out = header(1);
        digest(entries, &mut out);
        delta(ops, &mut out);
        out
    }

    /// An Ack (protocol V1).
    #[must_use]
    pub fn ack(ops: &[Op<'_>]) -> Vec<u8> {
        let mut out = header(2);
        delta(ops, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{craft::Op, *};

    fn id(name: &str, port: u16) -> ChitchatId {
        ChitchatId::new(name.to_string(), 7, ([192, 0, 2, 1], port).into())
    }

    /// A delta about this host's own node is refused, and names the highest version it holds
    /// of it (in an Ack or a `SynAck`, wherever it sits among the node deltas, a reset one
    /// included), which the transport weighs against this host's own max version.
    #[test]
    fn a_delta_about_this_hosts_own_node_names_how_far_it_goes() {
        let me = id("me", 1);
        let other = id("other", 2);
        let is_me = |i: &ChitchatId| *i == me;
        let own_max = |msg: &[u8]| {
            let mut m = None;
            assert_eq!(check_own(msg, is_me, &mut m), Err(Unsafe::OwnState));
            m
        };
        let trimmed = craft::ack(&[Op::Node(&me, 40, 40), Op::SetMax(41)]);
        assert_eq!(own_max(&trimmed), Some(41));
        let forged = craft::syn_ack(
            &[(&other, 3, 9)],
            &[
                Op::Node(&other, 0, 0),
                Op::Kv("s", "1:1:1", 3),
                Op::Node(&me, MAX_VERSION - 3, 0),
                Op::Kv("zz", "forged", MAX_VERSION - 2),
                Op::SetMax(MAX_VERSION - 2),
                Op::Node(&id("empty", 3), 0, 0),
            ],
        );
        assert_eq!(own_max(&forged), Some(MAX_VERSION - 2));
        let keys_only = craft::ack(&[Op::Node(&me, 0, 40), Op::Kv("zz", "x", 1_000)]);
        assert_eq!(own_max(&keys_only), Some(1_000));
        // Another member's delta says nothing of this host's own state.
        let mut m = None;
        let theirs = craft::ack(&[Op::Node(&other, 0, 0), Op::Kv("s", "x", 9)]);
        assert!(check_own(&theirs, is_me, &mut m).is_ok());
        assert_eq!(m, None);
    }

    /// The crafted messages of the review are refused, each for its reason; the same messages
    /// made consistent pass, and the digest's heartbeats are returned.
    #[test]
    fn crafted_deltas_that_would_crash_chitchat_are_refused() {
        let me = id("me", 1);
        let other = id("other", 2);
        let is_me = |i: &ChitchatId| *i == me;
        let ok = craft::ack(&[
            Op::Node(&other, 0, 0),
            Op::Kv("s", "1:1:1", 3),
            Op::Kv("t", "x", 4),
            Op::Node(&id("empty", 3), 0, 0),
            Op::SetMax(9),
        ]);
        assert_eq!(check(&ok, is_me), Ok(Vec::new()));
        // SetMaxVersion after a key of a higher version: chitchat's assertion.
        let below = craft::ack(&[
            Op::Node(&other, 0, 0),
            Op::Kv("s", "1:1:1", 10),
            Op::SetMax(5),
        ]);
        assert_eq!(check(&below, is_me), Err(Unsafe::MaxVersionBelowKeys));
        // A key of our own node at u64::MAX.
        let own = craft::ack(&[Op::Node(&me, 0, 0), Op::Kv("s", "x", 5)]);
        assert_eq!(check(&own, is_me), Err(Unsafe::OwnState));
        let huge = craft::ack(&[Op::Node(&other, 0, 0), Op::Kv("s", "x", u64::MAX)]);
        assert_eq!(check(&huge, is_me), Err(Unsafe::VersionTooLarge));
        // Digests: a heartbeat of u64::MAX for another member.
        let syn = craft::syn(&[(&other, 5, 3), (&me, 9, 9)], "c");
        assert_eq!(
            check(&syn, is_me),
            Ok(vec![(other.clone(), 5), (me.clone(), 9)])
        );
        let hb = craft::syn(&[(&other, u64::MAX, 3)], "c");
        assert_eq!(check(&hb, is_me), Err(Unsafe::HeartbeatTooLarge));
        let sa = craft::syn_ack(
            &[(&other, 5, 3)],
            &[Op::Node(&other, 0, 0), Op::Kv("k", "v", 1)],
        );
        assert_eq!(check(&sa, is_me), Ok(vec![(other.clone(), 5)]));
        // Truncated, junk, or a key before any node.
        assert_eq!(check(&ok[..ok.len() - 1], is_me), Err(Unsafe::Undecodable));
        assert_eq!(check(b"junk", is_me), Err(Unsafe::Undecodable));
        let orphan = craft::ack(&[Op::Kv("s", "x", 5)]);
        assert_eq!(check(&orphan, is_me), Err(Unsafe::Undecodable));
    }

    /// A member's heartbeat named by another sender far ahead of what the member itself last
    /// reported is refused; one within the slack (and what it may have gained since) passes; a
    /// member not heard directly is not judged; the sender's own report moves the mark.
    #[test]
    fn another_members_heartbeat_ahead_of_its_own_report_is_refused() {
        let (x, y) = (id("x", 1), id("y", 2));
        let mut h = Heartbeats::default();
        let from = |who: &ChitchatId| {
            let who = who.clone();
            move |i: &ChitchatId| *i == who
        };
        // Not heard from x yet: y may name any heartbeat for it.
        assert_eq!(
            h.check(&[(y.clone(), 5), (x.clone(), 1 << 40)], from(&y), 0),
            Ok(())
        );
        // x reports 100 itself.
        assert_eq!(h.check(&[(x.clone(), 100)], from(&x), 1_000), Ok(()));
        let ahead = 100 + HEARTBEAT_SLACK + 10 * HEARTBEATS_PER_MS;
        assert_eq!(h.check(&[(x.clone(), ahead)], from(&y), 1_010), Ok(()));
        assert_eq!(
            h.check(&[(x.clone(), ahead + 1)], from(&y), 1_010),
            Err(Unsafe::HeartbeatAhead)
        );
        assert_eq!(
            h.check(&[(x.clone(), u64::MAX)], from(&y), 1_010),
            Err(Unsafe::HeartbeatAhead)
        );
        // x itself may report any (it only concerns itself), and that moves the mark.
        assert_eq!(h.check(&[(x.clone(), 50_000)], from(&x), 2_000), Ok(()));
        assert_eq!(h.check(&[(x.clone(), 50_500)], from(&y), 2_000), Ok(()));
    }

    /// A node id longer than any agent's, in a digest or a delta, is refused (a Syn naming a few
    /// of 60 KB made the receiver's own digest too large to send); the longest an agent builds
    /// (`hostname/gossip address`, a 64-byte hostname and the longest IPv6 address) passes.
    #[test]
    fn node_ids_longer_than_an_agents_are_refused() {
        let me = id("me", 1);
        let is_me = |i: &ChitchatId| *i == me;
        let addr: std::net::SocketAddr = std::net::SocketAddrV6::new(
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap(),
            65_535,
            0,
            u32::MAX,
        )
        .into();
        let longest = format!("{}/{addr}", "h".repeat(64));
        assert!(longest.len() <= MAX_NODE_ID_LEN, "{}", longest.len());
        let agent = ChitchatId::new(longest, u64::MAX, addr);
        let ok = craft::syn(&[(&agent, 5, 3)], "c");
        assert_eq!(check(&ok, is_me).map(|d| d.len()), Ok(1));
        let padded = ChitchatId::new("x".repeat(60_000), 1, addr);
        let just_over = ChitchatId::new("x".repeat(MAX_NODE_ID_LEN + 1), 1, addr);
        for long in [&padded, &just_over] {
            let syn = craft::syn(&[(&agent, 5, 3), (long, 1, 0)], "c");
            assert_eq!(check(&syn, is_me), Err(Unsafe::NodeIdTooLong));
            let sa = craft::syn_ack(&[(long, 1, 0)], &[]);
            assert_eq!(check(&sa, is_me), Err(Unsafe::NodeIdTooLong));
            let ack = craft::ack(&[Op::Node(long, 0, 0), Op::Kv("k", "v", 1)]);
            assert_eq!(check(&ack, is_me), Err(Unsafe::NodeIdTooLong));
        }
    }

    /// The ids one sender address may introduce, and all senders together, are bounded: the
    /// rest are refused (to be stripped); the sender's own id and ids already known pass; an id
    /// that speaks for itself frees its introducer's quota; ids no digest names are forgotten.
    #[test]
    fn ids_a_digest_may_introduce_are_bounded_per_sender_and_in_all() {
        let ip = |n: u8| std::net::IpAddr::from([192, 0, 2, n]);
        let me = id("me", 1);
        let is_me = |i: &ChitchatId| *i == me;
        let phantoms = |tag: &str, n: usize| -> Vec<(ChitchatId, u64)> {
            (0..n)
                .map(|i| {
                    let [_, _, hi, lo] = u32::try_from(i).unwrap().to_be_bytes();
                    let addr = ([198, 18, hi, lo], 7946).into();
                    (ChitchatId::new(format!("{tag}{i}"), 1, addr), 1)
                })
                .collect()
        };
        let mut intro = Introductions::default();
        let evil = id("evil", 9);
        let from_evil = |i: &ChitchatId| *i == evil;
        let mut digest = vec![(evil.clone(), 1), (me.clone(), 1)];
        digest.extend(phantoms("p", 1_000));
        let refused = intro.admit(&digest, ip(9), from_evil, is_me, 0);
        assert_eq!(refused.len(), 1_000 - INTRODUCED_PER_IP);
        assert!(!refused.contains(&evil) && !refused.contains(&me));
        // The same digest again: what was admitted is known, the rest still refused.
        assert_eq!(intro.admit(&digest, ip(9), from_evil, is_me, 10), refused);
        // Other ids of the same address sending as themselves: at most OWN_IDS_PER_IP.
        let mut own_refused = 0;
        for g in 0..20u16 {
            let own = id("evil", 100 + g);
            let r = intro.admit(&[(own.clone(), 1)], ip(9), |i| *i == own, is_me, 20);
            own_refused += r.len();
        }
        assert_eq!(own_refused, 20 - (OWN_IDS_PER_IP - 1));
        // Other senders: together at most MAX_INTRODUCED introduced ids.
        let mut admitted = INTRODUCED_PER_IP;
        for n in 10..20u8 {
            let s = id("s", u16::from(n));
            let d = phantoms(&format!("q{n}-"), 100);
            let r = intro.admit(&d, ip(n), |i| *i == s, is_me, 30);
            admitted += 100 - r.len();
            assert!(100 - r.len() <= INTRODUCED_PER_IP);
        }
        assert_eq!(admitted, MAX_INTRODUCED);
        // A new member speaking for itself still gets in, full as the rest is.
        let newcomer = id("new", 77);
        assert!(intro
            .admit(
                &[(newcomer.clone(), 1)],
                ip(77),
                |i| *i == newcomer,
                is_me,
                40
            )
            .is_empty());
        // Introduced members that then speak for themselves free their introducer's quota.
        let honest = phantoms("p", INTRODUCED_PER_IP);
        for (h, _) in &honest {
            let r = intro.admit(
                &[(h.clone(), 1)],
                h.gossip_advertise_addr.ip(),
                |i| i == h,
                is_me,
                50,
            );
            assert!(r.is_empty());
        }
        let more = phantoms("r", 10);
        assert!(intro.admit(&more, ip(9), from_evil, is_me, 60).is_empty());
        // Ids no digest names for FORGET_MS are forgotten, and their quota freed.
        let later = 60 + FORGET_MS + 2_000;
        let fresh = phantoms("z", INTRODUCED_PER_IP);
        assert!(intro
            .admit(&fresh, ip(30), |_| false, is_me, later)
            .is_empty());
        // Senders at many addresses: at most MAX_OWN_IDS own ids in all.
        let mut own_admitted = 0;
        for n in 0..400u16 {
            let own = ChitchatId::new(format!("m{n}"), 1, ([198, 19, 1, 1], n).into());
            let from = std::net::IpAddr::from([198, 19, (n >> 8) as u8, n as u8]);
            let r = intro.admit(&[(own.clone(), 1)], from, |i| *i == own, is_me, later);
            own_admitted += 1 - r.len();
        }
        // (Beyond MAX_OWN_IDS, a sender's own id is taken as introduced: the room left there.)
        assert_eq!(
            own_admitted,
            MAX_OWN_IDS + MAX_INTRODUCED - INTRODUCED_PER_IP
        );
        // The worst case in this host's digest: every id at MAX_NODE_ID_LEN bytes, an IPv6
        // address, its heartbeat and versions; ours too.
        let entry = 2 + MAX_NODE_ID_LEN + 8 + 19 + 24;
        assert!((MAX_OWN_IDS + MAX_INTRODUCED + 1) * entry <= 47 * 1024);
    }

    /// [`strip`] removes the refused entries from a digest and leaves the rest of the message as
    /// it was, in both protocol versions.
    #[test]
    fn strip_leaves_out_refused_digest_entries_only() {
        use chitchat::Serializable;
        let me = id("me", 1);
        let is_me = |i: &ChitchatId| *i == me;
        let (x, y, z) = (id("x", 2), id("y", 3), id("z", 4));
        let not_y = |i: &ChitchatId| *i != y;
        let syn = craft::syn(&[(&x, 5, 1), (&y, 6, 2), (&z, 7, 3)], "c");
        let stripped = strip(&syn, not_y).unwrap();
        assert_eq!(
            check(&stripped, is_me),
            Ok(vec![(x.clone(), 5), (z.clone(), 7)])
        );
        assert!(stripped.ends_with(&{
            let mut c = Vec::new();
            "c".serialize(&mut c);
            c
        }));
        let ops = [Op::Node(&x, 0, 0), Op::Kv("k", "v", 1), Op::SetMax(4)];
        let sa = craft::syn_ack(&[(&y, 6, 2), (&x, 5, 1)], &ops);
        let stripped = strip(&sa, not_y).unwrap();
        assert_eq!(check(&stripped, is_me), Ok(vec![(x.clone(), 5)]));
        // The delta, byte for byte.
        assert!(stripped.ends_with(&craft::ack(&ops)[4..]));
        let ack = craft::ack(&ops);
        assert_eq!(strip(&ack, not_y).unwrap(), ack);
        // A large digest is compressed again (no larger than chitchat's own encoding).
        let many: Vec<ChitchatId> = (0..2_000).map(|i| id(&format!("member-{i}"), 7)).collect();
        let entries: Vec<(&ChitchatId, u64, u64)> = many.iter().map(|i| (i, 1, 1)).collect();
        let big = craft::syn(&entries, "c");
        let stripped = strip(&big, |i| *i != many[0]).unwrap();
        assert!(
            stripped.len() < big.len() / 4,
            "{} {}",
            stripped.len(),
            big.len()
        );
        assert_eq!(check(&stripped, is_me).map(|d| d.len()), Ok(1_999));
        // Protocol V0: a count, then the entries.
        let v0 = |entries: &[(&ChitchatId, u64)]| {
            let mut out = Vec::new();
            MAGIC_NUMBER.serialize(&mut out);
            out.extend([0, 0]);
            u16::try_from(entries.len()).unwrap().serialize(&mut out);
            for (i, hb) in entries {
                i.serialize(&mut out);
                hb.serialize(&mut out);
                0u64.serialize(&mut out);
                0u64.serialize(&mut out);
            }
            "c".serialize(&mut out);
            out
        };
        let stripped = strip(&v0(&[(&x, 5), (&y, 6), (&z, 7)]), not_y).unwrap();
        assert_eq!(stripped, v0(&[(&x, 5), (&z, 7)]));
        assert_eq!(
            check(&stripped, is_me),
            Ok(vec![(x.clone(), 5), (z.clone(), 7)])
        );
    }
}
