"""Summary table of the real-engine PX runs of bench/results/px-home/ (sluice alone, one seed per run)."""
import json, glob, os, re, statistics as st, sys
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(d, '*.json'))):
    name = os.path.basename(f)[:-5]
    m = re.match(r'(\w+?)-(base55|stayA|home55)-([\w.]+?)-(\d)$', name)
    if not m:
        continue
    batch, wt, var, seed = m.groups()
    var = var + 'share' if re.fullmatch(r'[\d.]+', var) else var
    label = {'base55': 'main (4e4ea7f)', 'home55': 'home term (final)'}.get(wt, f'variant {var}')
    v = json.load(open(f))['PX']['sluice']
    rows.setdefault(label, []).append((batch, int(seed), v))
keys = ['prefix_hit_rate', 'ttft_p95_s', 'slo_goodput_rps', 'failed']
print('Each cell: the mean; then each run.\n')
print('| placement | runs (batch/seed) | ' + ' | '.join(keys) + ' |')
print('|---|---|' + '---|' * len(keys))
for label, rs in rows.items():
    cells = []
    for k in keys:
        xs = [r[2][k] for r in rs]
        cells.append(f"{st.mean(xs):.3g}; " + ', '.join(f'{x:g}' for x in xs))
    print(f"| {label} | {len(rs)} ({', '.join(f'{b}/{s}' for b, s, _ in rs)}) | " + ' | '.join(cells) + ' |')
