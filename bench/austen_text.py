"""A real ~1 MB public-domain English text for the corpus benchmarks, from a Debian package, without R:
Jane Austen's novels as Debian's r-cran-janeaustenr ships them (an R lazy-load database, read here by a
tiny reader of R's XDR serialization: character vectors and named lists).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb x
    python3 bench/austen_text.py x/usr/lib/R/site-library/janeaustenr/data/Rdata /work/corpora-text/austen
    mkdir -p text && cat /work/corpora-text/austen/{prideprejudice,persuasion}.txt > text/austen.txt

text/austen.txt: 1,151,622 bytes, ASCII, sha256 4811f4bb642df4fa6669e08fbdef1d7339591ecb2575ce292cfe1856669da560
(r-cran-janeaustenr 1.0.0-1). Keep it out of git (text/ is the example configs' folder).
"""
import bz2, lzma, os, struct, sys, zlib

class R:
    def __init__(self, b): self.b, self.p, self.refs = b, 0, []
    def i(self):
        v = struct.unpack(">i", self.b[self.p:self.p+4])[0]; self.p += 4; return v
    def raw(self, n):
        v = self.b[self.p:self.p+n]; self.p += n; return v
    def header(self):
        assert self.raw(2) == b"X\n"
        ver = self.i(); self.i(); self.i()
        if ver == 3: self.raw(self.i())
    def item(self):
        flags = self.i(); t = flags & 0xFF; has_attr = flags & (1 << 9); has_tag = flags & (1 << 10)
        if t in (254, 242, 251, 253, 252): return None  # NILVALUE, EMPTYENV, ...
        if t == 255: return self.refs[(flags >> 8) - 1]
        if t == 1:  # SYMSXP
            s = self.item(); self.refs.append(s); return s
        if t == 9:  # CHARSXP
            n = self.i(); return None if n == -1 else self.raw(n).decode("utf-8", "replace")
        if t in (2, 17):  # LISTSXP pairlist
            out = {}
            while True:
                attr = self.item() if has_attr else None
                tag = self.item() if has_tag else None
                out[tag] = self.item()
                flags = self.i(); t = flags & 0xFF
                if t == 254: return out
                has_attr = flags & (1 << 9); has_tag = flags & (1 << 10)
                assert t == 2, t
        if t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.i(); v = [self.item() for _ in range(n)]
        elif t in (13, 10):
            n = self.i(); v = list(struct.unpack(f">{n}i", self.raw(4*n)))
        elif t == 14:
            n = self.i(); v = list(struct.unpack(f">{n}d", self.raw(8*n)))
        else:
            raise ValueError(f"type {t}")
        if has_attr:
            attrs = self.item(); v = (v, attrs)
        return v

def unpack(blob):
    if blob[:2] == b"\x1f\x8b":
        import gzip
        r = R(gzip.decompress(blob)); r.header(); return r.item()
    n = struct.unpack(">I", blob[:4])[0]
    if blob[4:5] in (b"Z", b"2", b"X", b"0"):
        kind, data = blob[4:5], blob[5:]
        data = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": lambda d: d}[kind](data)
    else:
        data = zlib.decompress(blob[4:])
    r = R(data); r.header(); return r.item()

base, out = sys.argv[1], sys.argv[2]
rdx = unpack(open(base + ".rdx", "rb").read())
vals, attrs = rdx
names = attrs["names"]
variables = dict(zip(names, vals))["variables"]
vlist, vattrs = variables
rdb = open(base + ".rdb", "rb").read()
os.makedirs(out, exist_ok=True)
for name, (off, length) in zip(vattrs["names"], [v[0] if isinstance(v, tuple) else v for v in vlist]):
    obj = unpack(rdb[off:off+length])
    lines = obj[0] if isinstance(obj, tuple) else obj
    text = "\n".join("" if l is None else l for l in lines) + "\n"
    open(os.path.join(out, name + ".txt"), "w").write(text)
    print(name, len(lines), len(text.encode()))
