# Marks the collection as the package deploy_tool.collection (setup.cfg package_dir), so pack finds it in
# deploytool's wheel; not part of the collection (galaxy.yml build_ignore).
