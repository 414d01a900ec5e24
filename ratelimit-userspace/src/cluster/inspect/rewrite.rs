//! Writing a checked message again: its digest without the entries refused, or with the
//! heartbeats of some written 0, the rest of it byte for byte.

use chitchat::ChitchatId;

use super::{de, digest_entry, stream, R};

/// Writes `body` as chitchat's block stream, uncompressed.
#[cfg(test)]
pub(super) fn block(body: &[u8], out: &mut Vec<u8>) {
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
///
/// [`check`]: super::check
/// [`Unsafe::Undecodable`]: super::Unsafe::Undecodable
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
///
/// [`check`]: super::check
/// [`Unsafe::Undecodable`]: super::Unsafe::Undecodable
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
