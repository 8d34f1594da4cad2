"""``kvgate deploy render``: a fleet YAML to launch scripts and configs, Kubernetes manifests or
a Helm chart (docs/disaggregation.md, docs/kubernetes.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvgate.engines.deploy import k8s as deploy_k8s
from kvgate.engines.deploy.render import load_fleet, render


def _cmd_render(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.fleet)
    if args.target == "scripts":
        files = render(fleet)
    else:
        files = (deploy_k8s.render_k8s(fleet) if args.target == "k8s"
                 else deploy_k8s.render_chart(fleet))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(files.items()):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        if name.endswith(".sh"):
            target.chmod(0o755)
        print(target)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("deploy", help="prefill/decode fleet deployment helpers")
    dsub = p.add_subparsers(dest="deploy_command", required=True)
    r = dsub.add_parser("render", help="write engine launch scripts and configs from a fleet YAML")
    r.add_argument("fleet", help="fleet YAML (docs/disaggregation.md)")
    r.add_argument("--out", default="deploy-out", help="output directory (default deploy-out)")
    r.add_argument("--target", choices=("scripts", "k8s", "helm"), default="scripts",
                   help="scripts: launch scripts + kvgate.yaml (default); k8s: Kubernetes "
                   "manifests; helm: a Helm chart (docs/kubernetes.md)")
    r.set_defaults(func=_cmd_render)
