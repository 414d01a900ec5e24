#!/bin/bash
# Run as root from the repository after `cargo xtask build --release`. Upgrade with a layout change, as the package's postinst does it: detach the old pins, start the
# new agent, wait until it enforces. Measures detach start -> "running" (READY) of the new agent.
set -u
BIN=${1:-target/release/ratelimit}
ip netns add rlgap-a; ip netns add rlgap-b
ip link add rlgap0 netns rlgap-a type veth peer name rlgap1 netns rlgap-b
ip -n rlgap-a link set rlgap0 up; ip -n rlgap-b link set rlgap1 up
D=$(mktemp -d)
PIN=/sys/fs/bpf/rlgap-$$
cat > $D/c.toml <<T
[agent]
interfaces = ["rlgap1"]
pin_path = "$PIN"
socket = "$D/a.sock"
[[rule]]
name = "r"
source = "198.18.0.0/15"
rate = 100
T
for i in 1 2 3 4 5; do
  nsenter --net=/run/netns/rlgap-b $BIN agent -c $D/c.toml --keep-attached > $D/old.log 2>&1 &
  until grep -q "running;" $D/old.log; do sleep 0.02; done
  kill -USR2 $!; wait $! 2>/dev/null
  t0=$(date +%s%N)
  $BIN --socket $D/a.sock detach --pin-path $PIN > /dev/null 2>&1
  nsenter --net=/run/netns/rlgap-b $BIN agent -c $D/c.toml > $D/new.log 2>&1 &
  NEW=$!
  until grep -q "running;" $D/new.log; do sleep 0.005; done
  t1=$(date +%s%N)
  echo "gap $(( (t1 - t0) / 1000000 )) ms"
  kill -TERM $NEW; wait $NEW 2>/dev/null
done
ip netns del rlgap-a; ip netns del rlgap-b; rm -rf $D; rm -rf $PIN 2>/dev/null
