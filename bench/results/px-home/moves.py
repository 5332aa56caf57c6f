"""Moves of each app's prefix between the replicas in a placement trace (trace.diff; python moves.py TRACE [-a])."""
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
t0=rows[0]['t']
addrs=sorted(rows[0]['bl'])
last={}; moves=0
print('rate',rows[5]['rate'],'tgt',rows[5]['tgt'])
for r in rows:
    a=r['app']; to=addrs.index(r['to'])
    mv = a in last and last[a]!=to
    moves+=mv; last[a]=to
    if mv or '-a' in sys.argv:
        sc=[r['sc'].get(x) for x in addrs]
        print(f"{r['t']-t0:6.2f} app{a:5d} n={r['n']:5d} ->{to} {'MOVE' if mv else '    '} cached={[r['cached'].get(x,0) for x in addrs]} conf={[r['conf'].get(x,0) for x in addrs]} inf={[r['inf'][x] for x in addrs]} sc={sc}")
print('moves',moves)
