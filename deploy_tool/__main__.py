from deploy_tool.cli import main

main()
