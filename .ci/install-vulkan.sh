#!/usr/bin/env bash
# Installs Mesa lavapipe 25 (software Vulkan) from Debian bookworm-backports, so the
# CubeCL kernel tests can run on `Device::wgpu(DeviceKind::Cpu)` without a GPU.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 \
   && ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 \
   && dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q '^25'; then
  echo "lavapipe 25 already installed"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  cat <<'SRC' | $SUDO tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
dpkg-query -W -f='mesa-vulkan-drivers ${Version}\n' mesa-vulkan-drivers
