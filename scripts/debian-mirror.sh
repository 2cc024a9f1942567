#!/usr/bin/env bash
# Print the Debian archive this host's apt already uses (its first `deb` source whose suite is a
# release, not -security), so installs fetch from the mirror the machine is set up for.
# CSI_QSD_DEBIAN_MIRROR overrides it. Exits 1 with a message when the host names none.
set -euo pipefail
if [ -n "${CSI_QSD_DEBIAN_MIRROR:-}" ]; then
  echo "$CSI_QSD_DEBIAN_MIRROR"
  exit 0
fi
shopt -s nullglob
# deb822 files: a stanza's URIs with its Suites; one-line files: "deb [options] URI SUITE ...".
mirror=$(
  {
    for file in /etc/apt/sources.list.d/*.sources; do
      awk 'BEGIN { RS = ""; FS = "\n" }
           { uris = ""; suites = ""; deb = 0
             for (i = 1; i <= NF; i++) {
               if ($i ~ /^Types:.*(^|[ \t])deb([ \t]|$)/) deb = 1
               if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris); split(uris, u, /[ \t]+/); uris = u[1] }
               if ($i ~ /^Suites:/) { suites = $i }
             }
             if (deb && uris != "" && suites !~ /-security/) print uris }' "$file"
    done
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [ -f "$file" ] || continue
      sed -E -n 's/^deb[ \t]+(\[[^]]*\][ \t]+)?([^ \t]+)[ \t]+([^ \t]+).*/\2 \3/p' "$file" \
        | awk '$2 !~ /-security/ { print $1 }'
    done
  } | head -n 1
)
if [ -z "$mirror" ]; then
  echo "debian-mirror: this host's apt sources name no Debian archive; set CSI_QSD_DEBIAN_MIRROR" >&2
  exit 1
fi
echo "${mirror%/}"
