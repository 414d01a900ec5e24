//! Maps for the hand-assembled programs: created with raw `bpf()` calls, filled through a
//! mapping or an update; the drivers' address arrays and their program arrays.

use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd};

use anyhow::{Context as _, Result};
use aya::programs::Xdp;

use super::{owned, sys_bpf};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_TYPE_PROG_ARRAY: u32 = 3;

/// `BPF_MAP_TYPE_ARRAY`.
pub const MAP_ARRAY: u32 = 2;
/// `BPF_F_MMAPABLE`.
pub const F_MMAPABLE: u32 = 1 << 10;

/// An array map for [`super::Sources::InTurn`]: `values` in a random order (placed by
/// [`crate::permutation::cyclic_permutation`] under a fixed seed, so runs draw the same order), then the
/// cursor (0); and the number of values.
pub fn turn_array(values: &[[u8; 4]]) -> Result<(OwnedFd, u32)> {
    let n = u32::try_from(values.len()).context("array length")?;
    anyhow::ensure!(n > 0, "no addresses to send from");
    let mut order: Vec<[u8; 4]> = crate::permutation::cyclic_permutation(n, TURN_SEED)
        .into_iter()
        .map(|i| values[i as usize])
        .collect();
    order.push([0; 4]);
    Ok((u32_array(&order)?, n))
}

/// An array map for [`super::Sources::InTurnWarm`]: as [`turn_array`], each entry 16 bytes, the
/// address and the first record of each of its key's two sets (`ratelimit_common::bucket_sets`,
/// times the ways), in the same order.
pub fn turn_array_warm(values: &[([u8; 4], [u32; 2])]) -> Result<(OwnedFd, u32)> {
    let n = u32::try_from(values.len()).context("array length")?;
    anyhow::ensure!(n > 0, "no addresses to send from");
    let mut bytes = Vec::with_capacity(16 * (values.len() + 1));
    for i in crate::permutation::cyclic_permutation(n, TURN_SEED) {
        let (addr, [first, second]) = values[i as usize];
        bytes.extend(addr);
        bytes.extend(first.to_ne_bytes());
        bytes.extend(second.to_ne_bytes());
        bytes.extend([0; 4]);
    }
    bytes.extend([0; 16]); // entry n: the cursor
    let map = create_map(MAP_ARRAY, 4, 16, n + 1, F_MMAPABLE)?;
    write_mapped(&map, &bytes)?;
    Ok((map, n))
}

/// Seed of [`turn_array`]'s order.
const TURN_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// An array map of `values` (u32 each, in memory order): created memory-mappable and written
/// through the mapping, where an array's values lie 8 bytes apart (the kernel rounds a value's
/// size up to 8 for its elements: written packed, entry `k` would read value `2k`, and the upper
/// half of the entries zero).
fn u32_array(values: &[[u8; 4]]) -> Result<OwnedFd> {
    let n = u32::try_from(values.len().max(1)).context("array length")?;
    let map = create_map(MAP_ARRAY, 4, 4, n, F_MMAPABLE)?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| [*v, [0; 4]]).flatten().collect();
    write_mapped(&map, &bytes)?;
    Ok(map)
}

/// Writes `bytes` at the start of the memory-mappable array map `map`, through a mapping.
pub fn write_mapped(map: &OwnedFd, bytes: &[u8]) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    // SAFETY: a fresh shared mapping of the array's first `bytes.len()` bytes (the kernel checks
    // the length against the map), written once and unmapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            map.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping an array map");
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast::<u8>(), bytes.len());
        libc::munmap(p, bytes.len());
    }
    Ok(())
}

/// Reads the first `len` bytes of the memory-mappable array map `map`, through a mapping.
pub fn read_mapped(map: &OwnedFd, len: usize) -> Result<Vec<u8>> {
    let mut bytes = vec![0u8; len];
    if len == 0 {
        return Ok(bytes);
    }
    // SAFETY: a fresh read-only shared mapping of the array's first `len` bytes (the kernel
    // checks the length against the map), read once and unmapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            map.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping an array map");
        }
        std::ptr::copy_nonoverlapping(p.cast::<u8>(), bytes.as_mut_ptr(), len);
        libc::munmap(p, len);
    }
    Ok(bytes)
}

/// Creates a map.
pub fn create_map(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
) -> Result<OwnedFd> {
    create_map_of(map_type, key_size, value_size, max_entries, map_flags, None)
}

/// Creates a map; `inner` is the template of an array of maps' inner maps.
pub(super) fn create_map_of(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner: Option<BorrowedFd<'_>>,
) -> Result<OwnedFd> {
    #[repr(C)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        inner_map_fd: u32,
    }
    let attr = MapCreate {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_flags,
        inner_map_fd: inner.map_or(0, |fd| u32::try_from(fd.as_raw_fd()).expect("fd")),
    };
    Ok(owned(sys_bpf(BPF_MAP_CREATE, &attr).with_context(
        || format!("creating a map of type {map_type}"),
    )?))
}

/// Sets entry `key` of `map` to the value at `value` (of the map's value size).
pub(super) fn update_elem<V>(map: BorrowedFd<'_>, key: u32, value: &V) -> std::io::Result<i64> {
    #[repr(C)]
    struct MapUpdate {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let attr = MapUpdate {
        map_fd: u32::try_from(map.as_raw_fd()).expect("fd"),
        _pad: 0,
        key: std::ptr::from_ref(&key) as u64,
        value: std::ptr::from_ref(value) as u64,
        flags: 0,
    };
    sys_bpf(BPF_MAP_UPDATE_ELEM, &attr)
}

/// A one-slot program array holding `target`, for a driver's tail call.
pub fn prog_array(target: &Xdp) -> Result<OwnedFd> {
    let map = create_map(BPF_MAP_TYPE_PROG_ARRAY, 4, 4, 1, 0)?;
    let value = u32::try_from(target.fd()?.as_fd().as_raw_fd()).expect("fd");
    update_elem(map.as_fd(), 0, &value)
        .context("putting the tail-call target in its program array")?;
    Ok(map)
}
