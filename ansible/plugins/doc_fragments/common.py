# -*- coding: utf-8 -*-
# The options every deploytool.fleet module that runs deploytool on the host shares (module_utils/deploytool.py
# COMMON_ARGS): where the box's config and deploytool's CLI are.

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  config:
    description: The box's config on the host (its C(paths.config), what the units' C(ExecStartPre) reads).
    type: path
    default: /etc/deploytool/deploytool.yaml
  root:
    description: The config's C(paths.root) (where C(current/tool/bin/deploytool) is found).
    type: path
    default: /opt/deploytool
  deploytool:
    description: deploytool's CLI on the host (default O(root)/current/tool/bin/deploytool).
    type: path
"""
