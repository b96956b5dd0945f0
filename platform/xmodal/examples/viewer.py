"""The example pages' one page: `index.html` is the whole viewer. It holds the summary (static HTML), and
every example's card, detail and data as one JSON document inlined in the page; a few lines of script draw
the list (filtered by the kind's facets, sorted by its measures, grouped in sections) and the selected
example's detail in place. Nothing navigates: MLflow's artifact viewer shows a page in a sandboxed frame
(`sandbox="allow-scripts"`, a blob: address) where following a link blanks the frame, so the page never
follows one. Opened as a file, the address's `#example=ID` selects an example and selecting one sets it.

The pictures are inlined once each (data: URIs in the JSON, keyed), and filled into the cards' and the
detail's `<img data-pic=KEY>` by the script. A kind adds a script of its own (`hook`), run on the detail
each time one is drawn (LXMERT's attention over the boxes: examples/qa.py).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field, replace
from typing import Any

from xmodal.examples.run import Shown
from xmodal.examples.stats import compare

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:1.2em;color:#222;font-size:14px}
table{border-collapse:collapse;margin:.3em 0;font-size:13px}td,th{border:1px solid #ccc;padding:1px 7px;text-align:left}
h1{font-size:1.5em;margin:.2em 0}h3{margin:.5em 0 .2em}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.right{color:#11772d}.wrong{color:#b3261e}.part{color:#8a6d00}
.tables{display:flex;flex-wrap:wrap;gap:0 1.5em;align-items:flex-start}
.controls{position:sticky;top:0;background:#f4f6f8;border:1px solid #dde;padding:6px 10px;margin:.6em 0;z-index:2}
.controls label{margin-right:1em}
.grid{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ccd;border-radius:4px;padding:5px;width:200px;font-size:13px;cursor:pointer;background:#fff}
.card:hover{border-color:#3563e9}.card.sel{outline:3px solid #3563e9}
.card img{max-width:100%;display:block;margin-bottom:3px}
#xm-detail{border:2px solid #3563e9;border-radius:6px;padding:8px 12px;margin:.6em 0;background:#fbfcff}
.nav button{margin-right:6px}
.runs{display:flex;gap:1.5em;flex-wrap:wrap;align-items:flex-start}.run{flex:1;min-width:min(530px,100%)}
.picrow{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}.xm-ent{margin:0 0 4px;max-width:420px}
.pic{position:relative;display:inline-block;margin:10px;line-height:0;max-width:calc(100% - 20px)}
.pic img{display:block;max-width:100%;height:auto}
.pic svg{position:absolute;left:0;top:0;width:100%;height:100%;pointer-events:none;overflow:visible}
.tok{margin:1px;padding:1px 6px;border:1px solid #bbb;background:#fff;cursor:pointer;font-size:13px}
.tok.on{background:#ffd7cc;border-color:#d55}
.bar{position:relative;width:160px;height:11px;background:#eef}.bar i{position:absolute;left:0;top:0;bottom:0;background:#3563e9}
.bar b{position:absolute;top:-2px;bottom:-2px;width:0;border-left:2px dashed #b3261e}
.note{background:#fff6d6;padding:4px 8px;border-left:3px solid #e0b000}
.legend{font-size:12px;color:#555}figure{margin:4px 10px 8px 0}figcaption{font-size:12px}
.question{font-size:1.2em}
"""

SCRIPT = """
(function(){
var D=JSON.parse(document.getElementById('xm-data').textContent),items=D.items,sel=-1,shown=[];
function $(id){return document.getElementById(id);}
function pics(root){root.querySelectorAll('img[data-pic]').forEach(function(im){im.src=D.pics[im.dataset.pic]||'';});}
function picked(){
  var f={};D.facets.forEach(function(x){var v=$('xm-f-'+x.key).value;if(v!=='')f[x.key]=v;});
  var idx=[];items.forEach(function(it,i){for(var k in f){if(it.facets[k]!==f[k])return;}idx.push(i);});
  var s=$('xm-sort').value;
  if(s){var p=s.split(':'),key=p[0],dir=+p[1];
    idx.sort(function(a,b){var x=items[a].sorts[key],y=items[b].sorts[key];
      var bx=x===null||x===undefined||isNaN(x),by=y===null||y===undefined||isNaN(y);
      if(bx||by)return bx===by?a-b:(bx?1:-1);return x===y?a-b:dir*(x-y);});}
  return idx;}
function list(){
  var idx=picked(),root=$('xm-list'),groups=D.groups.length?D.groups:[null];root.innerHTML='';shown=[];
  groups.forEach(function(g){
    var these=idx.filter(function(i){return g===null||items[i].facets[D.group]===g;});
    if(g!==null&&!these.length)return;
    var sec=document.createElement('section');
    if(g!==null){var h=document.createElement('h2');h.textContent=g+' ('+these.length+')';sec.appendChild(h);}
    var grid=document.createElement('div');grid.className='grid';
    these.forEach(function(i){shown.push(i);var c=document.createElement('div');
      c.className='card'+(i===sel?' sel':'');c.dataset.i=i;c.dataset.id=items[i].id;c.innerHTML=items[i].card;
      c.onclick=function(){select(i,true);};grid.appendChild(c);});
    sec.appendChild(grid);root.appendChild(sec);});
  $('xm-count').textContent=shown.length;pics(root);}
function select(i,scroll){
  sel=i;var it=items[i],d=$('xm-detail'),at=shown.indexOf(i);
  d.innerHTML='<div class=nav><button id=xm-prev>&larr; previous</button><button id=xm-next>next &rarr;</button>'+
    '<button id=xm-close>close</button> <span class=legend>'+(at<0?'not in the list as filtered':
    (at+1)+' of '+shown.length+' in the list')+'</span></div>'+it.detail;
  d.hidden=false;pics(d);if(window.XM_HOOK)window.XM_HOOK(d,it);
  $('xm-prev').onclick=function(){var k=shown.indexOf(sel);if(k>0)select(shown[k-1],false);};
  $('xm-next').onclick=function(){var k=shown.indexOf(sel);if(k>=0&&k+1<shown.length)select(shown[k+1],false);};
  $('xm-close').onclick=function(){d.hidden=true;d.innerHTML='';sel=-1;mark();};
  mark();try{history.replaceState(null,'','#example='+encodeURIComponent(it.id));}catch(e){}
  if(scroll){var bar=document.querySelector('.controls');window.scrollTo(0,d.getBoundingClientRect().top+
    window.pageYOffset-(bar?bar.offsetHeight:0)-6);}}
function mark(){document.querySelectorAll('.card').forEach(function(c){c.classList.toggle('sel',+c.dataset.i===sel);});}
function fromHash(){var m=/[#&]example=([^&]*)/.exec(location.hash||'');if(!m)return;
  var id=decodeURIComponent(m[1]);for(var i=0;i<items.length;i++)if(items[i].id===id){select(i,true);return;}}
D.facets.forEach(function(x){$('xm-f-'+x.key).onchange=list;});$('xm-sort').onchange=list;
list();fromHash();window.addEventListener('hashchange',fromHash);
window.XM_SELECT=select;
})();
"""


def esc(x: object) -> str:
    return html.escape(str(x))


@dataclass
class Item:
    """One example in the viewer: its card (in the list), its detail (drawn when selected), the values it is
    filtered by (`facets`: facet key -> value) and sorted by (`sorts`: sort key -> number; None sorts last),
    and the data the kind's script reads when drawing its detail."""

    id: str
    card: str
    detail: str
    facets: dict[str, str]
    sorts: dict[str, float | None]
    data: Any = None


@dataclass
class Facet:
    key: str
    label: str


@dataclass
class Measure:
    """A sort: `key` in the items' `sorts`; `first` says which end the default option shows first."""

    key: str
    label: str
    first: str = "highest"  # or "lowest"


@dataclass
class Viewer:
    """The page: its title, the summary above the list (HTML), the items, how they are filtered, sorted and
    grouped (`group`: a facet whose values, in `groups`' order, are the list's sections), the pictures
    (key -> data: URI), the kind's script, and JSON documents the page carries for other readers
    (`documents`: element id -> value, e.g. the comparison's counts)."""

    title: str
    summary: str
    items: list[Item]
    facets: list[Facet]
    measures: list[Measure]
    group: str | None = None
    groups: list[str] = field(default_factory=list)
    pictures: dict[str, str] = field(default_factory=dict)
    hook: str = ""
    documents: dict[str, Any] = field(default_factory=dict)


def in_sections(a: Shown, b: Shown | None, section, order: list[str]) -> tuple[Shown, Shown | None]:
    """Both runs' examples in the order of their sections (`section(x, y)` of A's and B's example, in
    `order`), each section in the chosen order: the list's order as listed, and the files' numbers."""
    ys = b.examples if b is not None else [None] * len(a.examples)
    at = sorted(range(len(a.examples)), key=lambda i: order.index(section(a.examples[i], ys[i])))
    a = replace(a, examples=[a.examples[i] for i in at])
    return a, (replace(b, examples=[b.examples[i] for i in at]) if b is not None else None)


def script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no `</` can end it early)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def controls(v: Viewer) -> str:
    """The filters (each facet's values with their counts) and the sort."""
    parts = []
    for f in v.facets:
        counts: dict[str, int] = {}
        for it in v.items:
            counts[it.facets[f.key]] = counts.get(it.facets[f.key], 0) + 1
        order = [g for g in v.groups if g in counts] if f.key == v.group else sorted(counts, key=lambda k: (-counts[k], k))
        opts = "".join(f"<option value='{esc(k)}'>{esc(k)} ({counts[k]})</option>" for k in order)
        parts.append(f"<label>{esc(f.label)} <select id='xm-f-{esc(f.key)}'><option value=''>all</option>{opts}"
                     "</select></label>")
    sorts = "".join(
        f"<option value='{esc(m.key)}:{-1 if hi else 1}'>{esc(m.label)}, {'highest' if hi else 'lowest'} first</option>"
        for m in v.measures for hi in ((True, False) if m.first == "highest" else (False, True)))
    parts.append(f"<label>sort <select id='xm-sort'><option value=''>as listed</option>{sorts}</select></label>")
    return (f"<div class='controls'>{''.join(parts)} <b>showing <span id='xm-count'>{len(v.items)}</span> of "
            f"{len(v.items)}</b> <span class='legend'>(click an example for its detail)</span></div>")


def page(v: Viewer) -> str:
    """The whole viewer as one HTML document."""
    data = {"items": [vars(it) for it in v.items], "facets": [vars(f) for f in v.facets],
            "group": v.group, "groups": v.groups, "pics": v.pictures}
    docs = "".join(f"<script type='application/json' id='{esc(k)}'>{script_json(x)}</script>"
                   for k, x in v.documents.items())
    body = (f"{v.summary}{controls(v)}<div id='xm-detail' hidden></div><div id='xm-list'></div>"
            f"<script type='application/json' id='xm-data'>{script_json(data)}</script>{docs}"
            f"<script>{v.hook}</script><script>{SCRIPT}</script>")
    return document(v.title, body)


def document(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{CSS}</style>"
            f"</head><body>{body}</body></html>\n")


def notes_html(notes: list[str]) -> str:
    return "".join(f"<p class='note'>{esc(x)}</p>" for x in notes)


def table(head: list[str], rows: list[list[Any]], numeric: set[int] | None = None) -> str:
    """An HTML table; the columns in `numeric` right-aligned. Cells are escaped (floats as given)."""
    numeric = numeric or set()
    th = "".join(f"<th{' class=n' if i in numeric else ''}>{esc(h)}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f"<td{' class=n' if i in numeric else ''}>{esc(c)}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def slug(text: str, most: int = 28) -> str:
    """A file-name part: lower-case letters, digits and hyphens."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")[:most].strip("-") or "x"


@dataclass
class Rendered:
    """A kind's pages: the index (the viewer), the files beside it (relative path -> bytes), the table of the
    examples for MLflow (column -> values; a column of PIL images is shown as pictures; None for a
    comparison), and the line the console prints about them."""

    index: str
    files: dict[str, bytes]
    table: dict[str, list] | None
    line: str


def two_by_two(c) -> str:
    return (f"<table id='xm-2x2'><tr><th></th><th class=n>B right</th><th class=n>B wrong</th></tr>"
            f"<tr><th>A right</th><td class=n>{c.both_right}</td><td class=n>{c.only_a}</td></tr>"
            f"<tr><th>A wrong</th><td class=n>{c.only_b}</td><td class=n>{c.both_wrong}</td></tr></table>"
            f"<p>both right {c.both_right}, only A {c.only_a}, only B {c.only_b}, both wrong {c.both_wrong}: "
            f"{c.total} examples.<br>McNemar's test ({c.test}, {c.only_a + c.only_b} disagreements): "
            f"<b>p = {c.p_value:.4g}</b></p>")


def comparison_doc(a: Shown, b: Shown | None) -> dict:
    """The comparison's counts as JSON in the page (`xm-comparison`), for other readers and the tests."""
    if b is None:
        return {}
    c = compare(a.examples, b.examples)
    return {"xm-comparison": {"a": a.run_id, "b": b.run_id, "examples": c.total, "a_right": a.right,
                              "b_right": b.right, "both_right": c.both_right, "only_a": c.only_a,
                              "only_b": c.only_b, "both_wrong": c.both_wrong, "p_value": c.p_value, "test": c.test}}
