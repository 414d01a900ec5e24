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

use super::rewrite::block;

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
