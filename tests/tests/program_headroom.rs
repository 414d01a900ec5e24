//! The XDP program's headroom under the verifier: the instructions it takes to verify and the
//! stack of every call chain, each printed and failed past its bound.

use ratelimit_testbed::{require_root, TestDataplane};

/// The program loads well inside the verifier's budget: at most half of the 1,000,000
/// instructions the kernel processes at most to verify a program. The program was at 974,468
/// (e9ca2cf): removing one `memset` call took it past the limit, and any change to the creation
/// path risked the same. `one_limit` as a global BPF function, verified once on its own rather
/// than once per caller state, brought it to 162,548 (c4667b4). A change that nears the limit
/// again fails here, with the count, before the program stops loading.
#[test]
fn the_program_loads_with_half_the_verifiers_budget_to_spare() {
    require_root();
    let dp = TestDataplane::new("verifier", 1024).unwrap();
    let n = dp
        .program()
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports the instructions it verified (5.16 and later)");
    println!("the verifier processed {n} instructions to load the program (limit 1,000,000)");
    assert!(
        n <= 500_000,
        "the verifier processed {n} instructions: over half its limit of 1,000,000"
    );
}

/// Every call chain of the program leaves a quarter of a frame's worth of the verifier's stack
/// spare: at most 448 of the 512 bytes (`MAX_BPF_STACK`) the verifier allows a chain, each
/// function's frame rounded to 16 bytes as it rounds them under the JIT. Read from the object the
/// tests load (`bpf_stack`: each function's deepest `r10` offset, and its BPF-to-BPF calls), and
/// every chain printed. Two chains were at 512 (`ratelimit` → `decide_cut`, 336 + 176, and
/// `ratelimit` → `one_limit` → `other_holder`, 336 + 160 + 16): one more spilled value in any of
/// those frames and the program no longer loaded. Fails naming the chains over.
#[test]
fn every_call_chain_leaves_64_bytes_of_the_verifiers_stack() {
    const MAX_CHAIN: u32 = 448;
    let object = ratelimit::dataplane::object();
    assert!(!object.is_empty(), "built without the XDP object");
    let (frames, chains) = ratelimit_testbed::bpf_stack::chains_of(object, "ratelimit").unwrap();
    let mut by_frame: Vec<_> = frames.functions.iter().filter(|f| f.depth > 0).collect();
    by_frame.sort_by_key(|f| std::cmp::Reverse(f.frame()));
    for f in by_frame {
        println!("frame {:4} B ({:3} deepest) {}", f.frame(), f.depth, f.name);
    }
    for c in &chains {
        println!("chain {}", frames.describe(c));
    }
    assert!(
        chains.len() > 1,
        "the program makes no BPF call: {chains:?}"
    );
    let over: Vec<String> = chains
        .iter()
        .filter(|c| c.stack > MAX_CHAIN)
        .map(|c| frames.describe(c))
        .collect();
    assert!(
        over.is_empty(),
        "call chains over {MAX_CHAIN} bytes of stack (the verifier refuses 512+): {over:#?}"
    );
}
