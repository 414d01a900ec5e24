//! `--profile`: where the limiter's program spends its time, by source line.
//!
//! `perf record` samples every CPU on the software clock (`cpu-clock`: this VM gives `perf` no
//! hardware counters) while the populations run; a sample whose address is in the program's
//! JIT image goes to the source line whose JIT'ed code holds it, read from the program's
//! `jited_line_info` and its BTF's strings through `BPF_OBJ_GET_INFO_BY_FD` (Debian's `bpftool`
//! is built without libbfd and cannot do it). An interrupt lands on the oldest instruction not
//! yet retired, so a line that waits for a load holds the wait.

use std::{
    collections::HashMap,
    fmt::Write as _,
    os::fd::{AsRawFd as _, BorrowedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{bail, ensure, Context as _, Result};

use crate::progs::{owned, sys_bpf};

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_BTF_GET_FD_BY_ID: libc::c_long = 19;

/// Byte offsets in `struct bpf_prog_info` (linux/bpf.h).
mod info {
    pub const NR_JITED_KSYMS: usize = 104;
    pub const NR_JITED_FUNC_LENS: usize = 108;
    pub const JITED_KSYMS: usize = 112;
    pub const JITED_FUNC_LENS: usize = 120;
    pub const BTF_ID: usize = 128;
    pub const NR_LINE_INFO: usize = 148;
    pub const LINE_INFO: usize = 152;
    pub const JITED_LINE_INFO: usize = 160;
    pub const NR_JITED_LINE_INFO: usize = 168;
    pub const LINE_INFO_REC_SIZE: usize = 172;
    pub const JITED_LINE_INFO_REC_SIZE: usize = 176;
    /// Enough for every field above.
    pub const SIZE: usize = 256;
}

/// The attribute of `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// Fills `buf` (a `struct bpf_*_info` prefix) for the object `fd`.
fn info_by_fd(fd: i32, buf: &mut [u8]) -> Result<()> {
    let attr = InfoAttr {
        bpf_fd: u32::try_from(fd).context("an fd")?,
        info_len: u32::try_from(buf.len()).context("an info length")?,
        info: buf.as_mut_ptr() as u64,
    };
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &attr).context("BPF_OBJ_GET_INFO_BY_FD")?;
    Ok(())
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

/// A source line's JIT'ed code starts at `addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    pub addr: u64,
    /// `file:line`, the file's name without its directories.
    pub at: String,
    /// The line's text, trimmed.
    pub src: String,
}

/// Where a loaded program's JIT'ed code lies: its functions (start, length) and its lines,
/// sorted by address.
#[derive(Debug, Default)]
pub struct Lines {
    pub funcs: Vec<(u64, u64)>,
    pub lines: Vec<Line>,
}

impl Lines {
    /// The JIT'ed program `prog`'s functions and lines.
    pub fn of(prog: BorrowedFd<'_>) -> Result<Self> {
        let fd = prog.as_raw_fd();
        let mut head = vec![0u8; info::SIZE];
        info_by_fd(fd, &mut head)?;
        let n_ksyms = get_u32(&head, info::NR_JITED_KSYMS) as usize;
        let n_lens = get_u32(&head, info::NR_JITED_FUNC_LENS) as usize;
        let n_lines = get_u32(&head, info::NR_LINE_INFO) as usize;
        let n_jlines = get_u32(&head, info::NR_JITED_LINE_INFO) as usize;
        let line_rec = get_u32(&head, info::LINE_INFO_REC_SIZE) as usize;
        let jline_rec = get_u32(&head, info::JITED_LINE_INFO_REC_SIZE) as usize;
        ensure!(
            n_ksyms > 0
                && n_ksyms == n_lens
                && n_lines > 0
                && n_lines == n_jlines
                && line_rec >= 16
                && jline_rec >= 8,
            "the program has no JIT'ed line info (is the JIT on, the program built with BTF?)"
        );
        let mut ksyms = vec![0u8; 8 * n_ksyms];
        let mut lens = vec![0u8; 4 * n_lens];
        let mut lines = vec![0u8; line_rec * n_lines];
        let mut jlines = vec![0u8; jline_rec * n_jlines];
        // The counts and record sizes the kernel gave, and where to write each array.
        let mut full = vec![0u8; info::SIZE];
        for at in [
            info::NR_JITED_KSYMS,
            info::NR_JITED_FUNC_LENS,
            info::NR_LINE_INFO,
            info::NR_JITED_LINE_INFO,
            info::LINE_INFO_REC_SIZE,
            info::JITED_LINE_INFO_REC_SIZE,
        ] {
            put_u32(&mut full, at, get_u32(&head, at));
        }
        for (at, buf) in [
            (info::JITED_KSYMS, ksyms.as_mut_ptr()),
            (info::JITED_FUNC_LENS, lens.as_mut_ptr()),
            (info::LINE_INFO, lines.as_mut_ptr()),
            (info::JITED_LINE_INFO, jlines.as_mut_ptr()),
        ] {
            put_u64(&mut full, at, buf as u64);
        }
        info_by_fd(fd, &mut full)?;
        let strings = btf_strings(get_u32(&head, info::BTF_ID))?;
        let string = |off: u32| -> String {
            let at = off as usize;
            let end = strings[at.min(strings.len())..]
                .iter()
                .position(|&b| b == 0)
                .map_or(strings.len(), |p| at + p);
            String::from_utf8_lossy(&strings[at.min(end)..end]).into_owned()
        };
        let funcs = (0..n_ksyms)
            .map(|i| {
                let addr = u64::from_ne_bytes(ksyms[8 * i..8 * i + 8].try_into().expect("8"));
                (addr, u64::from(get_u32(&lens, 4 * i)))
            })
            .collect();
        let mut out: Vec<Line> = (0..n_lines)
            .map(|i| {
                let rec = &lines[line_rec * i..];
                let file = string(get_u32(rec, 4));
                let src = string(get_u32(rec, 8));
                let line = get_u32(rec, 12) >> 10;
                let addr = u64::from_ne_bytes(
                    jlines[jline_rec * i..jline_rec * i + 8]
                        .try_into()
                        .expect("8"),
                );
                let name = file.rsplit('/').next().unwrap_or(&file);
                Line {
                    addr,
                    at: format!("{name}:{line}"),
                    src: src.trim().to_owned(),
                }
            })
            .collect();
        out.sort_by_key(|l| l.addr);
        Ok(Self { funcs, lines: out })
    }

    /// The line whose code holds `ip`, if `ip` is in one of the program's functions.
    pub fn line_of(&self, ip: u64) -> Option<&Line> {
        if !self
            .funcs
            .iter()
            .any(|&(start, len)| (start..start + len).contains(&ip))
        {
            return None;
        }
        let i = self.lines.partition_point(|l| l.addr <= ip);
        i.checked_sub(1).map(|i| &self.lines[i])
    }

    /// The samples (`(ip, count)`) in the program, summed by line (`file:line`, text, count),
    /// the most first; and how many samples that is.
    pub fn by_line(&self, samples: &[(u64, u64)]) -> (Vec<(String, String, u64)>, u64) {
        let mut counts: HashMap<(&str, &str), u64> = HashMap::new();
        let mut total = 0;
        for &(ip, n) in samples {
            if let Some(l) = self.line_of(ip) {
                *counts.entry((&l.at, &l.src)).or_default() += n;
                total += n;
            }
        }
        let mut rows: Vec<(String, String, u64)> = counts
            .into_iter()
            .map(|((at, src), n)| (at.to_owned(), src.to_owned(), n))
            .collect();
        rows.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        (rows, total)
    }
}

/// The string section of the BTF object `id`.
fn btf_strings(id: u32) -> Result<Vec<u8>> {
    let fd = owned(sys_bpf(BPF_BTF_GET_FD_BY_ID, &[id, 0, 0, 0]).context("BPF_BTF_GET_FD_BY_ID")?);
    // struct bpf_btf_info: btf (u64), btf_size (u32), id, name (u64), name_len, kernel_btf.
    let mut head = vec![0u8; 32];
    info_by_fd(fd.as_raw_fd(), &mut head)?;
    let size = get_u32(&head, 8) as usize;
    let mut raw = vec![0u8; size];
    let mut full = vec![0u8; 32];
    put_u64(&mut full, 0, raw.as_mut_ptr() as u64);
    put_u32(&mut full, 8, get_u32(&head, 8));
    info_by_fd(fd.as_raw_fd(), &mut full)?;
    // struct btf_header: magic (u16), version, flags (u8 each), hdr_len, type_off, type_len,
    // str_off, str_len (u32 each).
    ensure!(
        raw.len() >= 24 && raw[0..2] == 0xeb9f_u16.to_ne_bytes(),
        "not BTF"
    );
    let hdr = get_u32(&raw, 4) as usize;
    let (off, len) = (get_u32(&raw, 16) as usize, get_u32(&raw, 20) as usize);
    raw.get(hdr + off..hdr + off + len)
        .map(<[u8]>::to_vec)
        .context("BTF strings out of bounds")
}

/// `perf record` of every CPU on the software clock, until [`Recorder::stop`].
pub struct Recorder {
    child: Child,
    data: PathBuf,
}

impl Recorder {
    /// Starts recording into `data`.
    pub fn start(data: &Path) -> Result<Self> {
        let child = Command::new("perf")
            .args(["record", "-a", "-q", "-e", "cpu-clock", "-F", "10000", "-o"])
            .arg(data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("--profile needs perf (Debian's linux-perf)")?;
        // perf opens its events before it records; samples from before then are lost, not wrong.
        std::thread::sleep(std::time::Duration::from_millis(500));
        Ok(Self {
            child,
            data: data.to_owned(),
        })
    }

    /// Stops recording; the samples taken, `(ip, count)`.
    pub fn stop(mut self) -> Result<Vec<(u64, u64)>> {
        let pid = i32::try_from(self.child.id()).context("perf's pid")?;
        // SAFETY: a plain signal to our own child, which has not been waited for.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let status = self.child.wait().context("waiting for perf record")?;
        if !status.success() && status.code().is_some() {
            bail!("perf record failed: {status}");
        }
        let out = Command::new("perf")
            .args(["script", "-F", "ip", "-i"])
            .arg(&self.data)
            .stderr(Stdio::null())
            .output()
            .context("perf script")?;
        ensure!(out.status.success(), "perf script failed: {}", out.status);
        let mut counts: HashMap<u64, u64> = HashMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Ok(ip) = u64::from_str_radix(line.trim(), 16) {
                *counts.entry(ip).or_default() += 1;
            }
        }
        Ok(counts.into_iter().collect())
    }
}

/// The profile as text: the program's samples by line, the most first, down to 0.2%.
pub fn table(rows: &[(String, String, u64)], total: u64, what: &str) -> String {
    let mut s = format!("Where the limiter's program spends its time, {what}: {total} samples\n");
    for (at, src, n) in rows {
        #[expect(clippy::cast_precision_loss, reason = "sample counts")]
        let share = 100.0 * *n as f64 / total.max(1) as f64;
        if share < 0.2 {
            break;
        }
        let src: String = src.chars().take(90).collect();
        let _ = writeln!(s, "  {share:5.1}%  {at:24}  {src}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(addr: u64, at: &str) -> Line {
        Line {
            addr,
            at: at.into(),
            src: format!("code of {at}"),
        }
    }

    /// A sample goes to the last line starting at or before it, within the program's
    /// functions only; lines that share a `file:line` add up.
    #[test]
    fn samples_go_to_the_line_whose_code_holds_them() {
        let lines = Lines {
            funcs: vec![(1000, 100), (2000, 50)],
            lines: vec![
                line(1000, "a.rs:1"),
                line(1010, "b.rs:7"),
                line(1050, "a.rs:1"),
                line(2000, "c.rs:3"),
            ],
        };
        let samples = [
            (1000, 1),
            (1009, 2),
            (1010, 4),
            (1049, 8),
            (1099, 16),
            (1100, 32),
            (2049, 64),
            (999, 128),
            (5000, 256),
        ];
        let (rows, total) = lines.by_line(&samples);
        assert_eq!(total, 1 + 2 + 4 + 8 + 16 + 64);
        assert_eq!(
            rows.iter()
                .map(|(at, _, n)| (at.as_str(), *n))
                .collect::<Vec<_>>(),
            [("c.rs:3", 64), ("a.rs:1", 19), ("b.rs:7", 12)]
        );
        let text = table(&rows, total, "a test");
        assert!(text.contains(" 67.4%  c.rs:3"), "{text}");
    }
}
