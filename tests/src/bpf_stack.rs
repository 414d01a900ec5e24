//! The stack an eBPF object's call chains take, from the object itself: each function's frame
//! (its deepest `r10` offset, rounded as the verifier rounds it under the JIT) and its BPF-to-BPF
//! calls, summed along every chain from a program's entry. The verifier refuses a program one of
//! whose chains passes 512 bytes (`MAX_BPF_STACK`; ratelimit-ebpf/CONSTRAINTS.md, "Stack").
//!
//! A frame is what the code addresses below `r10`: loads and stores through `r10`, and through
//! a register set from `r10` and moved by a constant within the same straight run of code (how
//! LLVM passes a stack slot's address to a helper). An address kept in a stack slot and used
//! later is not followed (in the XDP program such addresses point into slots the code also
//! addresses directly). The verifier counts only the slots the paths it walks touch: for the
//! XDP program these figures are the verifier's (the two 512-byte chains it loaded at the limit
//! read 512 here too).

use std::collections::HashMap;

use anyhow::{bail, Context as _, Result};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget, SectionIndex};

/// The verifier's frame granule with the JIT on (`round_up_stack_depth`: 32 without it).
pub const FRAME_GRANULE: u32 = 16;

/// One function of the object.
#[derive(Debug, Clone)]
pub struct Function {
    /// The name, demangled to its path (`ratelimit::store::other_holder`).
    pub name: String,
    /// The deepest byte below `r10` it addresses.
    pub depth: u32,
    /// The functions it calls (indexes into [`Frames::functions`]), each once, in call order.
    pub calls: Vec<usize>,
}

impl Function {
    /// The frame as the verifier counts it on a chain: `depth` rounded up to [`FRAME_GRANULE`].
    #[must_use]
    pub fn frame(&self) -> u32 {
        self.depth.div_ceil(FRAME_GRANULE) * FRAME_GRANULE
    }
}

/// The functions of an object and the calls between them.
#[derive(Debug)]
pub struct Frames {
    pub functions: Vec<Function>,
}

/// A call chain from a program's entry: the functions in call order, and its stack.
#[derive(Debug, Clone)]
pub struct Chain {
    pub functions: Vec<usize>,
    /// The sum of the chain's frames (rounded).
    pub stack: u32,
}

impl Frames {
    /// The functions of the ELF object `elf` (every `FUNC` symbol of an executable section).
    ///
    /// # Errors
    /// The object does not parse, or a call's target is not a function's first instruction.
    pub fn of(elf: &[u8]) -> Result<Self> {
        let file = object::File::parse(elf).context("parsing the eBPF object")?;
        // Functions by section and start offset.
        let mut starts: HashMap<(SectionIndex, u64), usize> = HashMap::new();
        let mut extents = Vec::new();
        let mut functions = Vec::new();
        for sym in file.symbols() {
            if sym.kind() != object::SymbolKind::Text || sym.size() == 0 {
                continue;
            }
            let Some(section) = sym.section_index() else {
                continue;
            };
            starts.insert((section, sym.address()), functions.len());
            extents.push((section, sym.address(), sym.size()));
            functions.push(Function {
                name: short_name(sym.name().unwrap_or("?")),
                depth: 0,
                calls: Vec::new(),
            });
        }
        for (f, &(section_index, start, size)) in extents.iter().enumerate() {
            let section = file.section_by_index(section_index)?;
            let data = section.data()?;
            let relocations: HashMap<u64, object::Relocation> = section.relocations().collect();
            let code = data
                .get(start as usize..(start + size) as usize)
                .context("a function's code lies outside its section")?;
            let (depth, calls) = scan(code, |pc, imm| {
                // The call's target: in its own section at pc + imm + 1 (in instructions), or,
                // relocated, at imm + 1 from the relocation's symbol.
                let at = start + pc * 8;
                let (target_section, base) = match relocations.get(&at) {
                    Some(r) => {
                        let RelocationTarget::Symbol(i) = r.target() else {
                            bail!("a call relocated to no symbol at {at:#x}");
                        };
                        let sym = file.symbol_by_index(i)?;
                        let s = sym
                            .section_index()
                            .context("a call to an undefined symbol")?;
                        (s, sym.address())
                    }
                    None => (section_index, at),
                };
                let target = base.wrapping_add_signed((i64::from(imm) + 1) * 8);
                starts
                    .get(&(target_section, target))
                    .copied()
                    .with_context(|| {
                        format!("a call at {at:#x} to {target:#x}, no function's start")
                    })
            })?;
            functions[f].depth = depth;
            for c in calls {
                if !functions[f].calls.contains(&c) {
                    functions[f].calls.push(c);
                }
            }
        }
        Ok(Self { functions })
    }

    /// The function named `name`.
    #[must_use]
    pub fn function(&self, name: &str) -> Option<usize> {
        self.functions.iter().position(|f| f.name == name)
    }

    /// Every call chain from `entry`: the entry alone and each path through the call graph from
    /// it, ending at every call (so both `a → b` and `a → b → c`), in depth-first order.
    #[must_use]
    pub fn chains(&self, entry: usize) -> Vec<Chain> {
        let mut out = Vec::new();
        let mut path = vec![entry];
        self.walk(&mut path, &mut out);
        out
    }

    fn walk(&self, path: &mut Vec<usize>, out: &mut Vec<Chain>) {
        out.push(Chain {
            functions: path.clone(),
            stack: path.iter().map(|&f| self.functions[f].frame()).sum(),
        });
        let last = *path.last().expect("never empty");
        for &c in &self.functions[last].calls {
            // Recursion: the verifier refuses it; shown once, not followed.
            if path.contains(&c) {
                continue;
            }
            path.push(c);
            self.walk(path, out);
            path.pop();
        }
    }

    /// `chain` as `a (336) → b (160) = 496`.
    #[must_use]
    pub fn describe(&self, chain: &Chain) -> String {
        let names: Vec<String> = chain
            .functions
            .iter()
            .map(|&f| format!("{} ({})", self.functions[f].name, self.functions[f].frame()))
            .collect();
        format!("{} = {}", names.join(" → "), chain.stack)
    }
}

const LD_IMM64: u8 = 0x18;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const PSEUDO_CALL: u8 = 1;

/// An instruction's fields: opcode, dst, src, offset, immediate.
type Insn = (u8, u8, u8, i16, i32);

/// `code`'s instructions (whole 8-byte ones; the second half of a 64-bit load is one too).
fn decode(code: &[u8]) -> Vec<Insn> {
    code.chunks_exact(8)
        .map(|i| {
            (
                i[0],
                i[1] & 0xf,
                i[1] >> 4,
                i16::from_le_bytes([i[2], i[3]]),
                i32::from_le_bytes([i[4], i[5], i[6], i[7]]),
            )
        })
        .collect()
}

/// Where straight runs start (a jump lands there): a register's `r10 + k` is followed only
/// within one.
fn joins(insns: &[Insn]) -> Vec<bool> {
    let mut joins = vec![false; insns.len() + 1];
    for (pc, &(code, _, _, off, imm)) in insns.iter().enumerate() {
        let class = code & 7;
        if (class == 5 || class == 6) && code != CALL && code != EXIT {
            // gotol (JMP32 | JA) jumps by imm, the rest by off.
            let by = if code == 0x06 {
                i64::from(imm)
            } else {
                i64::from(off)
            };
            let to = pc as i64 + by + 1;
            if let Some(j) = usize::try_from(to).ok().and_then(|t| joins.get_mut(t)) {
                *j = true;
            }
        }
    }
    joins
}

/// The deepest `r10` offset addressed by `code` (whole instructions) and the functions it calls
/// (`target(pc, imm)` resolves a BPF-to-BPF call at instruction `pc`).
fn scan(
    code: &[u8],
    mut target: impl FnMut(u64, i32) -> Result<usize>,
) -> Result<(u32, Vec<usize>)> {
    let insns = decode(code);
    let joins = joins(&insns);
    let mut depth: i64 = 0;
    let mut calls = Vec::new();
    // Registers known to hold r10 + k.
    let mut from_fp: [Option<i64>; 11] = [None; 11];
    let mut pc = 0;
    while pc < insns.len() {
        if joins[pc] {
            from_fp = [None; 11];
        }
        let (code, dst, src, off, imm) = insns[pc];
        let (dst, src) = (usize::from(dst).min(10), usize::from(src).min(10));
        let class = code & 7;
        let mut deepest = |base: Option<i64>, off: i64| {
            if let Some(b) = base {
                depth = depth.max(-(b + off));
            }
        };
        let fp = |r: usize| if r == 10 { Some(0) } else { from_fp[r] };
        match class {
            // LDX: dst = *(src + off).
            1 => {
                deepest(fp(src), i64::from(off));
                from_fp[dst] = None;
            }
            // ST, STX (and atomics): *(dst + off) = ...; an atomic fetch writes its src (or r0).
            2 | 3 => {
                deepest(fp(dst), i64::from(off));
                if class == 3 && code & 0xe0 == 0xc0 {
                    from_fp[src] = None;
                    from_fp[0] = None;
                }
            }
            // ALU64.
            7 => {
                let op = code & 0xf0;
                let from_reg = code & 0x08 != 0;
                from_fp[dst] = match (op, from_reg) {
                    // mov dst, src
                    (0xb0, true) if off == 0 => fp(src),
                    // add dst, imm / sub dst, imm
                    (0x00, false) => from_fp[dst].map(|k| k + i64::from(imm)),
                    (0x10, false) => from_fp[dst].map(|k| k - i64::from(imm)),
                    _ => None,
                };
                deepest(from_fp[dst], 0);
            }
            0 if code == LD_IMM64 => {
                from_fp[dst] = None;
                pc += 1;
            }
            5 if code == CALL => {
                if src == usize::from(PSEUDO_CALL) {
                    calls.push(target(pc as u64, imm)?);
                }
                for r in &mut from_fp[..6] {
                    *r = None;
                }
            }
            // Conditional and unconditional jumps write no register.
            5 | 6 => {
                if code == EXIT || code == 0x05 || code == 0x06 {
                    from_fp = [None; 11];
                }
            }
            // ALU (32-bit) and the legacy packet loads write dst or r0.
            _ => {
                from_fp[dst] = None;
                from_fp[0] = None;
            }
        }
        pc += 1;
    }
    Ok((u32::try_from(depth).unwrap_or(u32::MAX), calls))
}

/// A Rust v0 symbol's path (`_RNvNtCs..._9ratelimit5store12other_holder` as
/// `ratelimit::store::other_holder`); any other name as it is.
fn short_name(name: &str) -> String {
    let Some(rest) = name.strip_prefix("_R") else {
        return name.to_owned();
    };
    // The crate root `Cs<disambiguator>_<len><name>`, then `<len><name>` per path segment.
    let Some(at) = rest
        .find("Cs")
        .and_then(|c| rest[c..].find('_').map(|u| c + u + 1))
    else {
        return name.to_owned();
    };
    let mut parts = Vec::new();
    let mut s = &rest[at..];
    while !s.is_empty() {
        let digits = s.chars().take_while(char::is_ascii_digit).count();
        let Ok(len) = s[..digits].parse::<usize>() else {
            return name.to_owned();
        };
        let Some(part) = s.get(digits..digits + len) else {
            return name.to_owned();
        };
        parts.push(part);
        s = &s[digits + len..];
    }
    parts.join("::")
}

/// The chains of `entry` in `elf` by their stack, largest first, with the table of frames.
///
/// # Errors
/// As [`Frames::of`], or no function is named `entry`.
pub fn chains_of(elf: &[u8], entry: &str) -> Result<(Frames, Vec<Chain>)> {
    let frames = Frames::of(elf)?;
    let e = frames
        .function(entry)
        .with_context(|| format!("no function {entry} in the object"))?;
    let mut chains = frames.chains(e);
    chains.sort_by_key(|c| std::cmp::Reverse(c.stack));
    Ok((frames, chains))
}
