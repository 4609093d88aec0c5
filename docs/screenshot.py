"""Screenshot the viewer on a demo run's turn (how docs/demo.png is made).

    python docs/screenshot.py out/demo [--out docs/demo.png] [--params 'mode=free']

Opens the demo's self-contained ``report.html`` (the viewer's renderer with the session
embedded) in headless Chromium (``/usr/bin/chromium`` or $TENSORVERSE_CHROMIUM, driven by
Playwright) on the turn of the first flip from ``summary.json`` (else the broken tool call's, else
the closest call's) and saves a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("demo_out", type=Path, help="the demo's output directory (report.html, summary.json)")
    ap.add_argument("--out", type=Path, default=Path("docs/demo.png"))
    ap.add_argument("--params", default="", help="viewer parameters for the turn, e.g. 'mode=free'")
    ap.add_argument("--width", type=int, default=1500)
    ap.add_argument("--height", type=int, default=900)
    args = ap.parse_args()
    summary = json.loads((args.demo_out / "summary.json").read_text())
    pick = summary.get("first_flip") or summary.get("broken_tool_call") or summary.get("closest_call")
    if not pick:
        print("screenshot: summary.json names no turn to show", file=sys.stderr)
        return 2
    url = (args.demo_out / "report.html").resolve().as_uri() + f"#/t/{pick['turn_id']}"
    if args.params:
        url += "?" + args.params
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.goto(url)
        page.wait_for_selector("body[data-view=turn]", timeout=30_000)
        page.wait_for_timeout(300)
        page.screenshot(path=str(args.out))
        browser.close()
    print(f"wrote {args.out} ({url.split('#')[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
